"""Tier 1: a bounded pool of host memory holding KV entries evicted from the device, least recently used out first.

Entries are CPU tensors made by the rank's `BlockContents` (pinned where the device is a GPU, so a load back is an
asynchronous copy). Which entries it holds depends only on the calls it gets, in order (saves, loads, evictions on
the stepping thread): the same on every rank of a DP worker. A load hands out the tensor at once; a later eviction
does not take it from a load in flight.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from moe_runtime.kv_tiers.connector import TierCounters
from moe_runtime.kv_tiers.entry_sizes import EntrySizes
from moe_runtime.kv_tiers.tier_key import TierKey


def completed(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, sizes: EntrySizes):
        self.capacity_bytes = capacity_bytes
        self.sizes = sizes
        self._entries: OrderedDict[TierKey, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()      # counters are read by the stats thread
        self._counters = TierCounters(self.name, capacity_bytes)

    def lookup(self, key: TierKey) -> bool:
        return key in self._entries

    def save_async(self, key: TierKey, data: torch.Tensor) -> list[TierKey]:
        size = self.sizes.of(key)
        if size > self.capacity_bytes:
            return []
        started = time.perf_counter()
        evicted = []
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return []
            while self._used + size > self.capacity_bytes:
                old, _ = self._entries.popitem(last=False)
                self._used -= self.sizes.of(old)
                evicted.append(old)
            self._entries[key] = data
            self._used += size
            self._counters.saved += 1
            self._counters.saved_bytes += data.numel()
            self._counters.save_seconds += time.perf_counter() - started
        return evicted

    def load_async(self, key: TierKey) -> Future:
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                self._counters.misses += 1
                return completed(None)
            self._entries.move_to_end(key)
            self._counters.hits += 1
            self._counters.loaded_bytes += data.numel()
        return completed(data)

    def evict(self, key: TierKey) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._used -= self.sizes.of(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def counters(self) -> TierCounters:
        with self._lock:
            self._counters.used_bytes = self._used
            self._counters.entries = len(self._entries)
            return TierCounters(**vars(self._counters))

    def close(self) -> None:
        self.clear()
