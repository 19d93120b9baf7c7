"""Prometheus metrics, written in the text exposition format (0.0.4) without a client library.

Counters and histograms are updated by the request handlers (event loop only). Engine-side
figures (queues, KV cache, token totals, expert load) are read from the `AsyncEngine` snapshots
when /metrics is scraped.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

PREFIX = "moe_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(value)


@dataclass
class Counter:
    name: str
    help: str
    label_names: tuple[str, ...] = ()
    values: dict[LabelValues, float] = field(default_factory=dict)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(self.values.items())]
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bucket (not cumulative), last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(list(self.buckets) + [math.inf], self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_number(float(bound))}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_number(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def gauge(name: str, help: str, samples: list[tuple[dict[str, str], float]], kind: str = "gauge") -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        names = tuple(labels)
        lines.append(f"{name}{_labels(names, tuple(labels[n] for n in names))} {_number(value)}")
    return lines


class ServerMetrics:
    """Everything /metrics reports. Request statuses: success, aborted, bad_request, rejected, error."""

    def __init__(self):
        self.requests = Counter(PREFIX + "requests_total", "Requests by final status.", ("status",))
        self.finish_reasons = Counter(PREFIX + "request_finish_total",
                                      "Finished choices by finish reason (stop, length, abort).", ("reason",))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between successive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", E2E_BUCKETS)

    def render(self, async_engine) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.finish_reasons, self.ttft, self.itl, self.e2e):
            lines += metric.render()
        lines += engine_lines(async_engine)
        return "\n".join(lines) + "\n"


def engine_lines(async_engine) -> list[str]:
    stats = async_engine.stats()
    health = async_engine.health()
    lines = gauge(PREFIX + "engine_healthy", "1 while every engine rank is alive, else 0.",
                  [({}, 1 if health.healthy else 0)])
    lines += gauge(PREFIX + "prompt_tokens_total", "Prompt tokens of admitted requests.",
                   [({}, stats.prompt_tokens)], "counter")
    lines += gauge(PREFIX + "generation_tokens_total", "Generated tokens.",
                   [({}, stats.generation_tokens)], "counter")
    lines += gauge(PREFIX + "queue_requests", "Requests submitted that have no first token yet (bounded by --max-queue).",
                   [({}, async_engine.num_unstarted)])
    per_worker = [
        ("num_requests_running", "Requests in the running batch of a DP worker.", lambda w: w.running, "gauge"),
        ("num_requests_waiting", "Requests waiting for admission on a DP worker.", lambda w: w.waiting, "gauge"),
        ("kv_cache_usage_ratio", "Fraction of a DP worker's KV blocks in use.", lambda w: w.kv_usage, "gauge"),
        ("kv_blocks_free", "Free KV cache blocks of a DP worker.", lambda w: w.kv_blocks_free, "gauge"),
        ("kv_blocks_total", "KV cache blocks of a DP worker.", lambda w: w.kv_blocks_total, "gauge"),
        ("num_preemptions_total", "Requests preempted (KV cache full) on a DP worker.",
         lambda w: w.num_preemptions, "counter"),
    ]
    for name, help, read, kind in per_worker:
        lines += gauge(PREFIX + name, help, [({"dp_rank": str(w.dp_rank)}, read(w)) for w in stats.workers], kind)
    lines += expert_load_lines(async_engine.expert_load())
    lines += rebalance_lines(async_engine.rebalance_events())
    return lines


def expert_load_lines(snapshot) -> list[str]:
    """Per-layer balance of an `ExpertLoadSnapshot` (none when the engine records no expert load)."""
    if snapshot is None:
        return []
    balancedness = [float(v) for v in snapshot.balancedness.tolist()]
    max_over_mean = [float(v) for v in snapshot.max_over_mean.tolist()]
    lines = gauge(PREFIX + "expert_balancedness", "Mean over max of per-rank expert load, per MoE layer (1 = even).",
                  [({"layer": str(i)}, v) for i, v in enumerate(balancedness)])
    lines += gauge(PREFIX + "expert_max_over_mean", "Max over mean of per-rank expert load, per MoE layer.",
                   [({"layer": str(i)}, v) for i, v in enumerate(max_over_mean)])
    lines += gauge(PREFIX + "expert_load_window_steps", "Steps the expert-load window covers.",
                   [({}, snapshot.window)])
    return lines


def rebalance_lines(events: list) -> list[str]:
    """Counts and durations of the engine's `RebalanceEvent`s (none when it keeps none)."""
    if not events:
        return []
    by_outcome = {"ok": 0, "failed": 0}
    for event in events:
        by_outcome["ok" if event.ok else "failed"] += 1
    last = events[-1]
    lines = gauge(PREFIX + "eplb_rebalances_total", "Expert rebalances, by outcome.",
                  [({"outcome": k}, v) for k, v in by_outcome.items()], "counter")
    lines += gauge(PREFIX + "eplb_rebalance_seconds_total", "Time spent rebalancing experts.",
                   [({}, sum(e.duration_s for e in events))], "counter")
    lines += gauge(PREFIX + "eplb_experts_moved_total", "Expert weights copied between ranks by rebalancing.",
                   [({}, sum(e.experts_moved for e in events if e.ok))], "counter")
    lines += gauge(PREFIX + "eplb_last_rebalance_seconds", "Duration of the latest rebalance.",
                   [({}, last.duration_s)])
    lines += gauge(PREFIX + "eplb_last_rebalance_balancedness", "Mean balancedness around the latest rebalance.",
                   [({"when": "before"}, last.balancedness_before), ({"when": "after"}, last.balancedness_after)])
    return lines


def parse_samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of an exposition (for tests and the benchmark)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples
