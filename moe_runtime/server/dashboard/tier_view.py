"""The KV-tier part of a DP worker in the dashboard state: each tier's occupancy and traffic, as plain JSON.

A worker without tiers gets an empty list (the page hides its tier panel when no worker has any).
"""
from __future__ import annotations

from moe_runtime.engine.stats import WorkerStats
from moe_runtime.kv_tiers.connector import TierCounters


def tier_view(tier: TierCounters) -> dict:
    """One tier, fastest first in its worker's list; `occupancy` in [0, 1] (0 for a tier of no capacity)."""
    return dict(name=tier.name, capacity_bytes=tier.capacity_bytes, used_bytes=tier.used_bytes,
                occupancy=tier.used_bytes / tier.capacity_bytes if tier.capacity_bytes > 0 else 0.0,
                entries=tier.entries, hits=tier.hits, misses=tier.misses, saved=tier.saved,
                saved_bytes=tier.saved_bytes, loaded_bytes=tier.loaded_bytes, errors=tier.errors)


def worker_tier_fields(worker: WorkerStats) -> dict:
    """The tier fields of a worker's entry in the state: its tiers, the requests waiting for a load, and the
    prompt tokens its admissions found in the tiers (cumulative)."""
    return dict(loading=worker.loading, kv_tier_hit_tokens=worker.kv_tier_hit_tokens,
                kv_tiers=[tier_view(tier) for tier in worker.kv_tiers])
