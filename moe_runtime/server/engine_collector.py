"""The engine's state as Prometheus metrics: a custom collector over one reading of the engine.

These figures live in the engine, not in the server's own metric objects, so they are read when
/metrics is scraped and turned into metric families on the spot (prometheus_client's custom
collector pattern), rather than mirrored into gauges that would have to be kept up to date.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from moe_runtime.load_balancer import ExpertLoadSnapshot, RebalanceEvent
from moe_runtime.engine.stats import EngineStats, RecoveryStats, WorkerStats
from moe_runtime.disaggregation.kv_transfer.stats import LatencyHistogram, TransferStats
from moe_runtime.server.kv_tier_metrics import kv_tier_families


@dataclass(frozen=True)
class EngineReading:
    """What one scrape reports about the engine, read from the `AsyncEngine`'s views in one go."""

    healthy: bool
    queued: int                               # submitted, no first token yet (what --max-queue bounds)
    stats: EngineStats
    expert_load: ExpertLoadSnapshot | None    # None: the engine records no expert load
    rebalance_events: list[RebalanceEvent]

    @classmethod
    def read(cls, async_engine, expert_load: ExpertLoadSnapshot | None) -> "EngineReading":
        """`expert_load` is the caller's: /metrics passes the fresh snapshot it awaited, the one
        /v1/expert_load serves, rather than the cached one, which can be up to 30 s old."""
        return cls(
            healthy=async_engine.front.health().healthy,
            queued=async_engine.num_unstarted,
            stats=async_engine.front.stats(),
            expert_load=expert_load,
            rebalance_events=async_engine.rebalance_events() or [],
        )


@dataclass(frozen=True)
class WorkerFigure:
    """One per-DP-worker series: its name (after the prefix), help text, kind and how to read it."""

    name: str
    documentation: str
    read: Callable[[WorkerStats], float]
    is_counter: bool = False


WORKER_FIGURES = (
    WorkerFigure("num_requests_running", "Requests in the running batch of a DP worker.", lambda w: w.running),
    WorkerFigure("num_requests_waiting", "Requests waiting for admission on a DP worker.", lambda w: w.waiting),
    WorkerFigure("kv_cache_usage_ratio", "Fraction of a DP worker's KV blocks in use.", lambda w: w.kv_usage),
    WorkerFigure("kv_blocks_free", "Free KV cache blocks of a DP worker.", lambda w: w.kv_blocks_free),
    WorkerFigure("kv_blocks_total", "KV cache blocks of a DP worker.", lambda w: w.kv_blocks_total),
    WorkerFigure("num_preemptions", "Requests preempted (KV cache full) on a DP worker.",
                 lambda w: w.num_preemptions, is_counter=True),
    WorkerFigure("prefix_cache_queries", "Tokens looked up in a DP worker's prefix cache at admission.",
                 lambda w: w.prefix_cache_queries, is_counter=True),
    WorkerFigure("spec_decode_num_draft_tokens", "Draft tokens a DP worker verified (speculative decoding).",
                 lambda w: w.spec_draft_tokens, is_counter=True),
    WorkerFigure("spec_decode_num_accepted_tokens", "Draft tokens a DP worker accepted (speculative decoding).",
                 lambda w: w.spec_accepted_tokens, is_counter=True),
    WorkerFigure("captured_decode_steps", "Decode steps a DP worker ran as the captured graph (--enable-torch-compile).",
                 lambda w: w.captured_decode_steps, is_counter=True),
    WorkerFigure("captured_verify_steps", "Of the captured steps, those that verified drafts (speculative decoding).",
                 lambda w: w.captured_verify_steps, is_counter=True),
    WorkerFigure("carried_decode_steps", "Of the captured steps, those whose inputs the previous step's graph computed.",
                 lambda w: w.carried_decode_steps, is_counter=True),
    WorkerFigure("prefix_cache_hits", "Tokens found in a DP worker's prefix cache at admission (not recomputed).",
                 lambda w: w.prefix_cache_hits, is_counter=True),
)


@dataclass(frozen=True, eq=False)   # eq=False: registries key collectors by identity
class EngineCollector:
    """Yields the metric families of one `EngineReading` (a collector for one scrape)."""

    prefix: str
    reading: EngineReading

    def collect(self) -> Iterator[Metric]:
        yield from self._engine_families()
        yield from self._worker_families(self.reading.stats.workers)
        yield from kv_tier_families(self.prefix, self.reading.stats.workers)
        if self.reading.expert_load is not None:
            yield from self._expert_load_families(self.reading.expert_load)
        if self.reading.rebalance_events:
            yield from self._rebalance_families(self.reading.rebalance_events)
        if self.reading.stats.transfer is not None:
            yield from self._transfer_families(self.reading.stats.transfer)
        if self.reading.stats.recovery is not None:
            yield from self._recovery_families(self.reading.stats.recovery)

    def _recovery_families(self, stats: RecoveryStats) -> Iterator[Metric]:
        """Lost worker ranks and the restarts that resumed their requests (`--max-rank-restarts`)."""
        p = self.prefix
        yield CounterMetricFamily(p + "lost_ranks", "Worker ranks lost (process exit, closed connection, failure).",
                                  value=stats.lost_ranks)
        yield CounterMetricFamily(p + "rank_recoveries", "Re-formations and restarts of the job's ranks that resumed "
                                  "its requests.", value=stats.recoveries)
        yield CounterMetricFamily(p + "rank_reformations", "Recoveries in which the surviving ranks went on without the "
                                  "lost ones, keeping their weights (no restart).", value=stats.reformations)
        yield CounterMetricFamily(p + "rank_recovery_seconds", "Time from a lost rank to every request resumed.",
                                  value=stats.recovery_seconds)
        yield CounterMetricFamily(p + "resumed_requests", "Requests resumed from their tokens so far (recomputed) "
                                  "after a lost rank.", value=stats.resumed_requests)
        yield GaugeMetricFamily(p + "rank_recovering", "1 while the job's ranks restart after a lost rank.",
                                value=1 if stats.recovering is not None else 0)

    def _transfer_families(self, stats: TransferStats) -> Iterator[Metric]:
        """Queue times by the instance's role ("none": colocated); on a P/D instance, the KV it moved and how
        long that took."""
        p = self.prefix
        yield from latency_families(p + "queue_seconds", "Time from a request's arrival on the ranks to its first "
                                    "scheduled step (imports: their KV transfer included), by the instance's role.",
                                    stats.queue_seconds, {"role": stats.role})
        if stats.role == "none":
            return
        yield CounterMetricFamily(p + "kv_transfer_bytes", "KV cache bytes pulled from prefill instances.",
                                  value=stats.bytes)
        outcomes = CounterMetricFamily(p + "kv_transfers", "KV imports settled, by outcome (recomputed: the transfer "
                                       "failed or its ranks were lost, the prompt ran here).", labels=["outcome"])
        outcomes.add_metric(["ok"], stats.transfers)
        outcomes.add_metric(["failed"], stats.failures)
        outcomes.add_metric(["recomputed"], stats.recomputed)
        yield outcomes
        exports = CounterMetricFamily(p + "kv_exports", "Prompts whose KV a prefill instance parked for a decode "
                                      "instance, and how their blocks were freed.", labels=["event"])
        exports.add_metric(["parked"], stats.exports)
        exports.add_metric(["released"], stats.exports_released)
        exports.add_metric(["expired"], stats.exports_expired)
        yield exports
        yield from latency_families(p + "kv_transfer_seconds", "Time to pull one request's KV (its slowest rank).",
                                    stats.seconds, {})

    def _engine_families(self) -> Iterator[Metric]:
        p, reading = self.prefix, self.reading
        yield GaugeMetricFamily(p + "engine_healthy", "1 while every engine rank is alive, else 0.",
                                value=1 if reading.healthy else 0)
        yield CounterMetricFamily(p + "prompt_tokens", "Prompt tokens of admitted requests.",
                                  value=reading.stats.prompt_tokens)
        yield CounterMetricFamily(p + "generation_tokens", "Generated tokens.", value=reading.stats.generation_tokens)
        yield GaugeMetricFamily(p + "queue_requests",
                                "Requests submitted that have no first token yet (bounded by --max-queue).",
                                value=reading.queued)

    def _worker_families(self, workers: list[WorkerStats]) -> Iterator[Metric]:
        for figure in WORKER_FIGURES:
            kind = CounterMetricFamily if figure.is_counter else GaugeMetricFamily
            family = kind(self.prefix + figure.name, figure.documentation, labels=["dp_rank"])
            for worker in workers:
                family.add_metric([str(worker.dp_rank)], figure.read(worker))
            yield family

    def _expert_load_families(self, snapshot: ExpertLoadSnapshot) -> Iterator[Metric]:
        p = self.prefix
        balancedness = GaugeMetricFamily(p + "expert_balancedness",
                                         "Mean over max of per-rank expert load, per MoE layer (1 = even).",
                                         labels=["layer"])
        for layer, value in enumerate(snapshot.balancedness.tolist()):
            balancedness.add_metric([str(layer)], float(value))
        max_over_mean = GaugeMetricFamily(p + "expert_max_over_mean",
                                          "Max over mean of per-rank expert load, per MoE layer.", labels=["layer"])
        for layer, value in enumerate(snapshot.max_over_mean.tolist()):
            max_over_mean.add_metric([str(layer)], float(value))
        yield balancedness
        yield max_over_mean
        yield GaugeMetricFamily(p + "expert_load_window_steps", "Steps the expert-load window covers.",
                                value=snapshot.window)

    def _rebalance_families(self, events: list[RebalanceEvent]) -> Iterator[Metric]:
        p, last = self.prefix, events[-1]
        by_outcome = CounterMetricFamily(p + "eplb_rebalances", "Expert rebalances, by outcome.", labels=["outcome"])
        by_outcome.add_metric(["ok"], sum(1 for e in events if e.ok))
        by_outcome.add_metric(["failed"], sum(1 for e in events if not e.ok))
        yield by_outcome
        yield CounterMetricFamily(p + "eplb_rebalance_seconds", "Time spent rebalancing experts.",
                                  value=sum(e.duration_s for e in events))
        yield CounterMetricFamily(p + "eplb_experts_moved", "Expert weights copied between ranks by rebalancing.",
                                  value=sum(e.experts_moved for e in events if e.ok))
        yield GaugeMetricFamily(p + "eplb_last_rebalance_seconds", "Duration of the latest rebalance.",
                                value=last.duration_s)
        around_last = GaugeMetricFamily(p + "eplb_last_rebalance_balancedness",
                                        "Mean balancedness around the latest rebalance.", labels=["when"])
        around_last.add_metric(["before"], last.balancedness_before)
        around_last.add_metric(["after"], last.balancedness_after)
        yield around_last


def latency_families(name: str, documentation: str, histogram: LatencyHistogram,
                     labels: dict[str, str]) -> Iterator[Metric]:
    """A histogram family, and a `_quantile` gauge with the p50 and p99 of its recent samples."""
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), histogram.cumulative(), sum_value=histogram.total)
    yield family
    quantiles = GaugeMetricFamily(name + "_quantile", documentation + " Recent p50 and p99.",
                                  labels=[*labels, "quantile"])
    for q in (0.5, 0.99):
        value = histogram.quantile(q)
        if value is not None:
            quantiles.add_metric([*labels.values(), str(q)], value)
    yield quantiles
