"""What /metrics reports, with prometheus_client: the server's request metrics and the engine's state.

The request handlers (event loop only) count requests and finish reasons and observe latencies into
metrics held in a `CollectorRegistry` of the app's own (several apps in one process, as in the tests,
never share counts). The engine's figures are read at scrape time into an `EngineCollector`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moe_runtime.load_balancer import ExpertLoadSnapshot
from moe_runtime.server.engine_collector import EngineCollector, EngineReading

PREFIX = "moe_"
CONTENT_TYPE = CONTENT_TYPE_LATEST   # the exposition format `generate_latest` writes

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

REQUEST_STATUSES = ("success", "aborted", "bad_request", "unauthorized", "rejected", "error")
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class LabeledCounter:
    """A one-label prometheus_client `Counter`, counted as `inc("label value")` (the handlers' form)."""

    counter: Counter

    @classmethod
    def create(cls, name: str, documentation: str, label: str, known_values: Iterable[str],
               registry: CollectorRegistry) -> "LabeledCounter":
        counter = Counter(name, documentation, [label], registry=registry)
        for value in known_values:   # exported as 0 from the start: rate() needs a series before its first event
            counter.labels(value)
        return cls(counter)

    def inc(self, label_value: str, amount: float = 1.0) -> None:
        self.counter.labels(label_value).inc(amount)


class ServerMetrics:
    """The app's request metrics (`requests`, `finish_reasons`, `ttft`, `itl`, `e2e`) and their registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = LabeledCounter.create(
            PREFIX + "requests", "POST /v1 requests by final status (" + ", ".join(REQUEST_STATUSES) + ").",
            "status", REQUEST_STATUSES, self.registry)
        self.finish_reasons = LabeledCounter.create(
            PREFIX + "request_finish",
            "Engine requests (one per choice) finished, by finish reason (stop, length, abort, error: "
            "the engine failed the request).", "reason", FINISH_REASONS, self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between successive generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)

    def render(self, async_engine, expert_load: ExpertLoadSnapshot | None) -> bytes:
        """The exposition of one scrape: the app's registry plus the engine read now, with `expert_load`
        (the snapshot the caller took; see `EngineReading.read`).

        The engine collector holds this scrape's reading, so it goes into a registry of its own for
        this scrape, next to the app's: no reading is left behind for the next one.
        """
        scrape = CollectorRegistry()
        scrape.register(self.registry)
        scrape.register(EngineCollector(PREFIX, EngineReading.read(async_engine, expert_load)))
        return generate_latest(scrape)


def parse_samples(text: str) -> dict[str, float]:
    """`name{label="value",...}` -> value for every sample of an exposition (for tests and benchmarks).

    Keys are spelled as the sample lines are (labels in their order, values unescaped).
    """
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{name}="{value}"' for name, value in sample.labels.items())
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples
