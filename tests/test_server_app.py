"""The app in process over a fake engine: engine death (5xx, error events, /health 503), 429, expert load, hooks."""
import asyncio
import json

import httpx
import pytest
import torch
from fastapi import APIRouter
from server_harness import FakeEngine

from moe_runtime.load_balancer import ExpertLoadRecorder, RebalanceEvent
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server import build_app
from moe_runtime.server.metrics import parse_samples

pytestmark = pytest.mark.timeout(60)


def serve(engine: FakeEngine, max_queue=None, **app_kwargs):
    """Run `fn(client, async_engine)` against the app on `engine` (one event loop, ASGI transport)."""

    def runner(fn):
        async def main():
            async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=max_queue)).start()
            app = build_app(async_engine, "fake", **app_kwargs)
            transport = httpx.ASGITransport(app=app)
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                    return await fn(client, async_engine)
            finally:
                await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

        return asyncio.run(asyncio.wait_for(main(), 30))

    return runner


def sse_events(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


def test_engine_death_fails_a_plain_request_with_503_and_health_turns_503():
    async def scenario(client, _):
        health_before = await client.get("/health")
        dying = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 100})
        health_after = await client.get("/health")
        later = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        metrics = parse_samples((await client.get("/metrics")).text)
        return health_before, dying, health_after, later, metrics

    before, dying, after, later, metrics = serve(FakeEngine(step_delay_s=0.002, die_at_step=5))(scenario)
    assert before.status_code == 200
    assert dying.status_code == 503
    error = dying.json()["error"]
    assert error["message"] == "the engine is unavailable" and error["code"] == "engine_dead"   # why: in the log
    assert set(error) == {"message", "type", "param", "code"}
    assert after.status_code == 503 and after.json() == {"status": "unhealthy"}
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
    assert metrics["moe_engine_healthy"] == 0
    assert metrics['moe_requests_total{status="error"}'] == 2


def test_engine_death_mid_stream_sends_an_error_event_then_closes():
    async def scenario(client, _):
        return await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 100, "stream": True})

    response = serve(FakeEngine(step_delay_s=0.002, die_at_step=6))(scenario)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert all("choices" in c for c in chunks[:-1]) and len(chunks) >= 2  # some tokens came out first
    error = chunks[-1]["error"]
    assert error["code"] == "engine_dead" and error["message"] == "the engine is unavailable"


def test_engine_health_failing_while_idle_makes_health_503():
    async def scenario(client, _):
        for _ in range(100):
            response = await client.get("/health")
            if response.status_code == 503:
                return response
            await asyncio.sleep(0.01)
        return response

    response = serve(FakeEngine(health_fails_at_step=0))(scenario)
    assert response.status_code == 503 and response.json() == {"status": "unhealthy"}   # the detail is logged


def test_queue_full_is_429_with_retry_after():
    async def scenario(client, async_engine):
        running = await async_engine.submit("run", [1], SamplingParams(max_tokens=1000))
        await running.__anext__()
        await async_engine.submit("queued", [1], SamplingParams(max_tokens=2))
        refused = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        async_engine.front.abort("run")
        metrics = parse_samples((await client.get("/metrics")).text)
        return refused, metrics

    refused, metrics = serve(FakeEngine(max_running=1, step_delay_s=0.005), max_queue=1)(scenario)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    assert metrics['moe_requests_total{status="rejected"}'] == 1


def fake_snapshot():
    recorder = ExpertLoadRecorder(num_layers=2, num_experts=4, num_slots=4, num_ranks=2, window=8)
    recorder.record(0, torch.tensor([[0, 1], [0, 0], [0, 2]]))   # rank 0 holds experts 0, 1: 5 of 6
    recorder.record(1, torch.tensor([[0, 2], [1, 3], [0, 3]]))   # 3 / 3: even
    recorder.end_step()
    return recorder.snapshot()


def rebalance_event(index: int, ok: bool = True) -> RebalanceEvent:
    return RebalanceEvent(index=index, trigger="interval", started_at=1.0e9 + index, duration_s=0.25,
                          experts_moved=4, balancedness_before=0.5, balancedness_after=0.8 + index / 100, ok=ok,
                          error=None if ok else "rank 1 ran out of memory")


def test_expert_load_is_served_as_json_and_as_metrics():
    snapshot = fake_snapshot()

    async def scenario(client, _):
        return (await client.get("/v1/expert_load")).json(), (await client.get("/metrics")).text

    events = [rebalance_event(0), rebalance_event(1, ok=False), rebalance_event(2)]
    body, text = serve(FakeEngine(expert_load=snapshot, rebalance_events=events))(scenario)
    assert body == snapshot.to_dict()
    samples = parse_samples(text)
    assert samples['moe_expert_balancedness{layer="0"}'] == pytest.approx(3 / 5)
    assert samples['moe_expert_balancedness{layer="1"}'] == pytest.approx(1.0)
    assert samples['moe_expert_max_over_mean{layer="0"}'] == pytest.approx(5 / 3)
    assert samples['moe_eplb_rebalances_total{outcome="ok"}'] == 2
    assert samples['moe_eplb_rebalances_total{outcome="failed"}'] == 1
    assert samples["moe_eplb_rebalance_seconds_total"] == 0.75
    assert samples["moe_eplb_experts_moved_total"] == 8
    assert samples['moe_eplb_last_rebalance_balancedness{when="after"}'] == pytest.approx(0.82)


def test_a_failed_engine_operation_reports_its_error_and_the_engine_keeps_serving():
    engine = FakeEngine()

    async def scenario(client, async_engine):
        with pytest.raises(InvalidRequestError, match="nothing to rebalance"):
            await async_engine.rebalance_now()
        served = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        return served.status_code, async_engine.front.health().healthy

    status, healthy = serve(engine)(scenario)
    assert status == 200 and healthy  # a failed operation does not kill the engine


def test_no_expert_load_is_a_404_error_body():
    async def scenario(client, _):
        return await client.get("/v1/expert_load")

    response = serve(FakeEngine())(scenario)
    assert response.status_code == 404 and response.json()["error"]["code"] == "no_expert_load"


def test_metrics_count_requests_tokens_and_latency():
    async def scenario(client, _):
        ok = await client.post("/v1/completions", json={"prompt": [7], "max_tokens": 5, "n": 2})
        bad = await client.post("/v1/completions", json={"prompt": [7], "max_tokens": 0})
        return ok, bad, parse_samples((await client.get("/metrics")).text)

    ok, bad, samples = serve(FakeEngine())(scenario)
    assert ok.status_code == 200 and bad.status_code == 400
    assert [c["text"] for c in ok.json()["choices"]] == ["8 9 10 11 12"] * 2
    assert ok.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11}
    assert samples['moe_requests_total{status="success"}'] == 1
    assert samples['moe_requests_total{status="bad_request"}'] == 1
    assert samples['moe_request_finish_total{reason="length"}'] == 2
    assert samples["moe_time_to_first_token_seconds_count"] == 2
    assert samples["moe_inter_token_latency_seconds_count"] == 8   # 4 gaps per choice
    assert samples["moe_generation_tokens_total"] == 10
    assert samples['moe_kv_blocks_free{dp_rank="0"}'] == 100


def test_api_key_guards_v1_but_not_health():
    async def scenario(client, _):
        return (
            (await client.get("/v1/models")).status_code,
            (await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code,
            (await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code,
            (await client.get("/health")).status_code,
        )

    assert serve(FakeEngine(), api_key="s3cret")(scenario) == (401, 401, 200, 200)


def test_extra_routers_plug_into_the_app():
    router = APIRouter()

    @router.get("/dashboard/ping")
    async def ping():
        return {"pong": True}

    async def scenario(client, _):
        return await client.get("/dashboard/ping")

    assert serve(FakeEngine(), extra_routers=[router])(scenario).json() == {"pong": True}
