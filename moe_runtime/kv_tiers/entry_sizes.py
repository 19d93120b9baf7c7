"""The bytes a tier counts for each kind of entry: the same numbers on every rank of a DP worker.

A tier is bounded in bytes, and which entries it evicts must be the same on every rank of a DP worker (they admit
requests from its lookups without talking). The ranks' own entries differ in size (a pipeline stage holds some
layers, an attention-TP rank some heads), so each tier counts every entry of a kind at the largest size any rank of
the job has for it, agreed once at start (`EngineTiers`); the bytes a rank actually keeps are at most that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.kv_tiers.tier_key import TierKey


@dataclass(frozen=True)
class EntrySizes:
    by_kind: dict[int, int] = field(default_factory=dict)    # TierKey.kind -> bytes counted per entry

    def of(self, key: TierKey) -> int:
        return self.by_kind.get(key.kind, 0)
