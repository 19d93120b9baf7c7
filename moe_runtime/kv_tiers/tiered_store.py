"""The tiers below the device pool, fastest first, as one store: host memory above disk (or either alone).

Saving writes through: an entry goes into every tier, so the disk holds everything the host holds (a restart finds
it) and a host eviction loses nothing the disk keeps. A load asks the fastest tier holding the key. An entry leaves
the store when no tier holds it any more (`save`'s return: what the front's cache-aware router is told was evicted).
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from moe_runtime.kv_tiers.connector import KVTierConnector, TierCounters
from moe_runtime.kv_tiers.host_tier import completed
from moe_runtime.kv_tiers.tier_key import TierKey


class TieredStore:
    def __init__(self, tiers: list[KVTierConnector]):
        if not tiers:
            raise ValueError("a tiered store needs a tier")
        self.tiers = tiers

    def holds(self, key: TierKey) -> bool:
        return any(tier.lookup(key) for tier in self.tiers)

    def save(self, key: TierKey, data: torch.Tensor) -> list[TierKey]:
        """Keep `data` under `key` in every tier; the keys no tier holds any more since."""
        evicted: list[TierKey] = []
        for tier in self.tiers:
            evicted.extend(tier.save_async(key, data))
        return [old for old in dict.fromkeys(evicted) if not self.holds(old)]

    def load_async(self, key: TierKey) -> Future:
        for tier in self.tiers:
            if tier.lookup(key):
                return tier.load_async(key)
        return completed(None)

    def drop(self, key: TierKey) -> None:
        """Forget `key` in every tier (its entry could not be loaded on some rank)."""
        for tier in self.tiers:
            tier.evict(key)

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def counters(self) -> list[TierCounters]:
        return [tier.counters() for tier in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
