"""/metrics with prometheus_client: one registry per app, the shared expert load, requests the engine failed."""
import asyncio
import logging

import httpx
import pytest
import torch
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from server_harness import FakeEngine

from moe_runtime.load_balancer import ExpertLoadRecorder, RebalanceEvent
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.server import build_app
from moe_runtime.server.metrics import parse_samples

pytestmark = pytest.mark.timeout(60)

FAILING_TOKEN = 666   # FailingEngine fails every request whose prompt ends with it
REFRESH_S = 0.05      # a short expert-load refresh period: a test waits it out to see a new load


def serve(engine, scenario, expert_load_refresh_s: float = 1.0):
    """`await scenario(client)` against `build_app` on `engine` (one event loop, ASGI transport)."""

    async def main():
        config = AsyncEngineConfig(expert_load_refresh_s=expert_load_refresh_s)
        async_engine = AsyncEngine(engine, config).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "fake"))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                return await scenario(client)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 30))


async def scrape(client) -> dict[str, float]:
    return parse_samples((await client.get("/metrics")).text)


def snapshot_with_rank_loads(rank0_tokens: int, rank1_tokens: int):
    """Two layers, two ranks of two experts each; layer 0 routes the given tokens per rank, layer 1 is even."""
    recorder = ExpertLoadRecorder(num_layers=2, num_experts=4, num_slots=4, num_ranks=2, window=8)
    recorder.record(0, torch.tensor([[0, 1]] * rank0_tokens + [[2, 3]] * rank1_tokens))
    recorder.record(1, torch.tensor([[0, 2]] * 4))
    recorder.end_step()
    return recorder.snapshot()


def rebalance_event(index: int) -> RebalanceEvent:
    return RebalanceEvent(index=index, trigger="manual", started_at=1.0e9 + index, duration_s=0.5, experts_moved=2,
                          balancedness_before=0.5, balancedness_after=0.9)


def test_metrics_and_expert_load_agree_after_the_load_changes():
    engine = FakeEngine(expert_load=snapshot_with_rank_loads(3, 1))
    changed = snapshot_with_rank_loads(1, 4)

    async def scenario(client):
        before = await scrape(client)
        engine.snapshot = changed                  # the load moves between scrapes...
        engine.events.append(rebalance_event(0))   # ...and a rebalance happened
        await asyncio.sleep(2 * REFRESH_S)         # the shared snapshot is refreshed at most every REFRESH_S
        after = await scrape(client)               # /metrics first: no /v1/expert_load call refreshed the cache
        served = (await client.get("/v1/expert_load")).json()
        return before, after, served

    before, after, served = serve(engine, scenario, expert_load_refresh_s=REFRESH_S)
    assert before['moe_expert_balancedness{layer="0"}'] == pytest.approx(2 / 3)   # mean 2 over max 3
    assert served == changed.to_dict()
    for layer in (0, 1):
        assert after[f'moe_expert_balancedness{{layer="{layer}"}}'] == pytest.approx(served["balancedness"][layer])
        assert after[f'moe_expert_max_over_mean{{layer="{layer}"}}'] == pytest.approx(served["max_over_mean"][layer])
    assert after['moe_expert_balancedness{layer="0"}'] == pytest.approx(2.5 / 4)
    assert after['moe_eplb_rebalances_total{outcome="ok"}'] == 1
    assert after["moe_eplb_last_rebalance_seconds"] == 0.5


def test_metrics_use_prometheus_client_exposition_and_one_registry_per_app():
    async def scenario(client):
        ok = await client.post("/v1/completions", json={"prompt": [7], "max_tokens": 3})
        return ok, await client.get("/metrics")

    ok, first = serve(FakeEngine(), scenario)
    _, second = serve(FakeEngine(), scenario)   # a second app in the same process starts from zero
    assert ok.status_code == 200
    assert first.headers["content-type"] == CONTENT_TYPE_LATEST
    kinds = {family.name: family.type for family in text_string_to_metric_families(first.text)}
    assert kinds["moe_requests"] == "counter" and kinds["moe_time_to_first_token_seconds"] == "histogram"
    assert kinds["moe_kv_cache_usage_ratio"] == "gauge" and kinds["moe_num_preemptions"] == "counter"
    for response in (first, second):
        samples = parse_samples(response.text)
        assert samples['moe_requests_total{status="success"}'] == 1
        assert samples['moe_request_finish_total{reason="length"}'] == 1
        assert samples['moe_request_finish_total{reason="error"}'] == 0   # every reason is exported from the start
        assert samples["moe_e2e_request_latency_seconds_count"] == 1
        assert samples['moe_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1


class FailingEngine(FakeEngine):
    """Fails, alone, every request whose prompt ends with FAILING_TOKEN (as when its sampling raised)."""

    def step(self) -> list[RequestOutput]:
        failing = [r for r in [*self.waiting, *self.running] if r.prompt[-1] == FAILING_TOKEN]
        for request in failing:
            (self.waiting if request in self.waiting else self.running).remove(request)
        failed = [RequestOutput(request_id=r.request_id, prompt_token_ids=r.prompt, token_ids=[], text="",
                                finished=True, finish_reason="error", error="ValueError: sampling blew up")
                  for r in failing]
        return failed + super().step()


def test_a_request_the_engine_failed_is_a_500_counted_as_error(caplog):
    async def scenario(client):
        failed = await client.post("/v1/completions", json={"prompt": [1, FAILING_TOKEN], "max_tokens": 4})
        streamed = await client.post("/v1/completions",
                                     json={"prompt": [FAILING_TOKEN], "max_tokens": 4, "stream": True})
        ok = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 4})
        return failed, streamed, ok, await scrape(client)

    with caplog.at_level(logging.WARNING, logger="moe_runtime.server.errors"):
        failed, streamed, ok, samples = serve(FailingEngine(), scenario)
    assert failed.status_code == 500
    assert failed.json() == {"error": {"message": "the engine failed this request", "type": "internal_server_error",
                                       "param": None, "code": "request_failed"}}
    assert '"code": "request_failed"' in streamed.text and "sampling blew up" not in streamed.text
    assert ok.status_code == 200   # the engine serves on
    logged = [r for r in caplog.records if r.name == "moe_runtime.server.errors"]
    assert logged and all(r.levelno == logging.WARNING and r.exc_info is None for r in logged)
    assert any("sampling blew up" in r.getMessage() for r in logged)   # the detail is in the log only
    assert samples['moe_request_finish_total{reason="error"}'] == 2
    assert samples['moe_requests_total{status="error"}'] == 2
    assert samples['moe_requests_total{status="success"}'] == 1
