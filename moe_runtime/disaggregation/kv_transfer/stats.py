"""What a P/D instance's front counts about KV transfers and queues, for /metrics and benchmarks.

Kept by the front (one per engine), read by the server at scrape time: cumulative counters, and
latency histograms with fixed buckets (what Prometheus wants) plus a window of recent samples for
p50/p99 read directly.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECENT_SAMPLES = 2048


@dataclass
class LatencyHistogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)      # [len(buckets) + 1]: the last is +Inf
    total: float = 0.0
    count: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_SAMPLES))

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
        self.counts[index] += 1
        self.total += seconds
        self.count += 1
        self.recent.append(seconds)

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the recent samples (nearest rank), or None before the first."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]

    def copy(self) -> "LatencyHistogram":
        return LatencyHistogram(self.buckets, list(self.counts), self.total, self.count,
                                deque(self.recent, maxlen=RECENT_SAMPLES))

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, count of samples at or below it), +Inf last."""
        running, out = 0, []
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass
class TransferStats:
    role: str                                 # "prefill" | "decode" | "none"
    transfers: int = 0                        # imports whose KV landed (decode)
    failures: int = 0                         # imports that failed their request (decode: its grammar)
    recomputed: int = 0                       # imports whose transfer failed or timed out, or was in flight when
                                              # this instance's ranks were lost: the prompt computed here (decode)
    bytes: int = 0                            # KV bytes pulled (decode)
    exports: int = 0                          # requests whose KV was parked for a decode instance (prefill)
    exports_released: int = 0                 # ... freed after their decode instance said so (prefill)
    exports_expired: int = 0                  # ... freed at the timeout (prefill)
    seconds: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(TRANSFER_BUCKETS))
    queue_seconds: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(QUEUE_BUCKETS))

    def snapshot(self) -> "TransferStats":
        """A copy for readers on other threads (the server reads stats while the engine thread counts)."""
        return dataclasses.replace(self, seconds=self.seconds.copy(), queue_seconds=self.queue_seconds.copy())
