"""The router's /metrics: requests by how they were served, the prefill phase's latency, each instance's state.

The KV transfer itself (bytes, seconds, queue times per role) is measured where it happens: each
instance's own /metrics (`moe_kv_transfer_*`, `moe_queue_seconds`).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moe_runtime.server.pd_router.backends import BackendPool

PREFIX = "moe_"   # as moe-serve's own metrics (server.metrics, not imported: it brings the engine, and torch)

OUTCOMES = ("disaggregated", "decode_only", "prefill_only", "prefill_fallback", "prefill_failed", "decode_failed",
            "no_instance", "refused", "aborted")
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, pool: BackendPool):
        self.pool = pool
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "router_requests", "Requests by how they were served: disaggregated (prefill, then decode), "
            "decode_only (whole on a decode instance: n > 1, echo, prompt logprobs, max_tokens < 2), prefill_only "
            "(the first token ended it: the prefill's answer), prefill_fallback (whole on a decode instance: no "
            "prefill instance could take it), or how they failed.", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:   # exported as 0 from the start
            self.requests.labels(outcome)
        self.prefill_seconds = Histogram(PREFIX + "router_prefill_seconds",
                                         "Time a prefill instance took to answer (queue, prefill, first token).",
                                         buckets=PREFILL_BUCKETS, registry=self.registry)
        self.healthy = Gauge(PREFIX + "router_instance_healthy", "1 while an instance's /health answers 200.",
                             ["role", "url"], registry=self.registry)
        self.in_flight = Gauge(PREFIX + "router_instance_requests", "Requests an instance is serving for the router.",
                               ["role", "url"], registry=self.registry)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        for backend in self.pool.backends:
            self.healthy.labels(backend.role, backend.url).set(1 if backend.status == "ok" else 0)
            self.in_flight.labels(backend.role, backend.url).set(backend.in_flight)
        return generate_latest(self.registry)
