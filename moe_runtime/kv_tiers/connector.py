"""The Protocol a KV tier below the device pool implements: what the engine asks of host memory, a disk, or an
external store (LMCache, Mooncake) plugged in without touching the engine.

An entry is the bytes one rank keeps of one `TierKey` (its layers, its heads): a flat uint8 CPU tensor whose
layout only the rank's `BlockContents` knows. The engine calls `lookup` and `evict` and `save_async` on its
stepping thread and decides admissions from `lookup`; the ranks of a DP worker decide alike without talking, so a
connector's `lookup` must answer from the sequence of `save_async`/`evict` calls alone (never from whether a write
finished or a peer answered). What cannot be promised that way is checked when it is loaded: `load_async`'s future
gives None for an entry it could not bring back (a corrupted file, an I/O error, a store that lost it), the ranks
agree on the first such entry, and the request recomputes from there; a miss is never a wrong answer.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from moe_runtime.kv_tiers.tier_key import TierKey


@dataclass
class TierCounters:
    """One tier's traffic since start and what it holds now (the `/metrics` families `moe_kv_tier_*`)."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    entries: int = 0
    hits: int = 0                 # entries loaded from this tier
    misses: int = 0               # entries it was asked for and could not give back (corrupt, lost, I/O error)
    saved: int = 0                # entries written into it
    saved_bytes: int = 0
    loaded_bytes: int = 0
    save_seconds: float = 0.0     # time spent writing (off the stepping thread for the disk)
    load_seconds: float = 0.0     # time spent reading (off the stepping thread)
    errors: int = 0               # writes or reads that failed (full disk, I/O errors)


class KVTierConnector(Protocol):
    name: str

    def lookup(self, key: TierKey) -> bool:
        """Whether an entry was saved under `key` and not evicted since (its bytes are checked only when loaded)."""

    def save_async(self, key: TierKey, data: torch.Tensor) -> list[TierKey]:
        """Keep `data` (uint8 [N], owned by the tier from now on) under `key`, returning before any slow write;
        the keys it evicted to make room (least recently used first)."""

    def load_async(self, key: TierKey) -> Future:
        """A future of the entry's bytes (uint8 [N]), or of None when they cannot be brought back."""

    def evict(self, key: TierKey) -> None:
        """Forget `key` (its memory or file is freed)."""

    def clear(self) -> None:
        """Forget every entry."""

    def counters(self) -> TierCounters:
        ...

    def close(self) -> None:
        ...
