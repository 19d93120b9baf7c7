"""The KV tiers below each DP worker's device pool as Prometheus families `moe_kv_tier_*` (labels `tier`, `dp_rank`).

Each worker reports its tiers' `TierCounters` (moe_runtime/kv_tiers/connector.py) in its `WorkerStats`, fastest
first: traffic since start (counters) and what each tier holds now (gauges). The tier counters are those of the
rank that reported the worker's step (every rank of a worker keeps its own shard of each entry, and the ranks
evict alike, so their entry counts agree; their bytes are each rank's shard). A worker without tiers adds no
sample to the per-tier families; the two per-worker ones (tokens found in the tiers, requests loading) read 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from moe_runtime.engine.stats import WorkerStats
from moe_runtime.kv_tiers.connector import TierCounters


@dataclass(frozen=True)
class TierFigure:
    """One per-tier, per-worker series: its name (after `<prefix>kv_tier_`), help text, kind and how to read it."""

    name: str
    documentation: str
    read: Callable[[TierCounters], float]
    is_counter: bool = False


TIER_FIGURES = (
    TierFigure("hits", "Entries loaded back from a KV tier into a DP worker's device pool.",
               lambda t: t.hits, is_counter=True),
    TierFigure("misses", "Entries a KV tier was asked for and could not give back (corrupt, lost, I/O error).",
               lambda t: t.misses, is_counter=True),
    TierFigure("saved_entries", "Entries written into a KV tier (blocks and state snapshots the device pool reused).",
               lambda t: t.saved, is_counter=True),
    TierFigure("saved_bytes", "Bytes written into a KV tier.", lambda t: t.saved_bytes, is_counter=True),
    TierFigure("loaded_bytes", "Bytes loaded back from a KV tier.", lambda t: t.loaded_bytes, is_counter=True),
    TierFigure("save_seconds", "Time spent writing into a KV tier (off the stepping thread for the disk).",
               lambda t: t.save_seconds, is_counter=True),
    TierFigure("load_seconds", "Time spent loading from a KV tier (off the stepping thread).",
               lambda t: t.load_seconds, is_counter=True),
    TierFigure("errors", "Writes or reads of a KV tier that failed (full disk, I/O errors).",
               lambda t: t.errors, is_counter=True),
    TierFigure("used_bytes", "Bytes a KV tier holds now.", lambda t: t.used_bytes),
    TierFigure("capacity_bytes", "Bytes a KV tier may hold (--kv-host-memory, --kv-disk-size).",
               lambda t: t.capacity_bytes),
    TierFigure("entries", "Entries a KV tier holds now.", lambda t: t.entries),
)


def kv_tier_families(prefix: str, workers: list[WorkerStats]) -> Iterator[Metric]:
    """Every `TIER_FIGURES` family by (tier, dp_rank), then the tokens admissions found in the tiers and the
    requests waiting for a load, by dp_rank."""
    base = prefix + "kv_tier_"
    for figure in TIER_FIGURES:
        kind = CounterMetricFamily if figure.is_counter else GaugeMetricFamily
        family = kind(base + figure.name, figure.documentation, labels=["tier", "dp_rank"])
        for worker in workers:
            for tier in worker.kv_tiers:
                family.add_metric([tier.name, str(worker.dp_rank)], figure.read(tier))
        yield family
    hit_tokens = CounterMetricFamily(base + "hit_tokens", "Prompt tokens a DP worker's admissions found in its KV "
                                     "tiers (not on the device, not recomputed).", labels=["dp_rank"])
    loading = GaugeMetricFamily(base + "requests_loading", "Requests of a DP worker waiting for their prefix to "
                                "come back from its KV tiers.", labels=["dp_rank"])
    for worker in workers:
        hit_tokens.add_metric([str(worker.dp_rank)], worker.kv_tier_hit_tokens)
        loading.add_metric([str(worker.dp_rank)], worker.loading)
    yield hit_tokens
    yield loading
