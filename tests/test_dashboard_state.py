"""The dashboard's server side in process, over fake engines: state vs /v1/expert_load, timeline, trace,
rebalance (available, refused, unavailable, API key), local assets, a dead engine."""
import asyncio
import json
import math
import re
from importlib import resources
from pathlib import Path

import httpx
import pytest
import torch
from dashboard_fakes import RoutingFakeEngine
from server_harness import FakeEngine

from moe_runtime.load_balancer import ExpertLoadRecorder, Placement, load_trace
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.engine.stats import EngineStats, WorkerStats
from moe_runtime.server import build_app
from moe_runtime.server.dashboard import DashboardConfig, dashboard_router
from moe_runtime.server.dashboard.load_view import load_view
from moe_runtime.server.dashboard.timeline import Timeline

pytestmark = pytest.mark.timeout(60)

REFRESH_S = 0.05   # the engine's expert-load snapshot, which /v1/expert_load and the dashboard read, is this old at most


def serve(engine, api_key=None, **dashboard_kwargs):
    """Run `await fn(client)` against the app (with the dashboard) on `engine`, over the ASGI transport."""

    def runner(fn):
        async def main():
            async_engine = AsyncEngine(engine, AsyncEngineConfig(expert_load_refresh_s=REFRESH_S)).start()
            router = dashboard_router(api_key=api_key, config=DashboardConfig(**dashboard_kwargs))
            app = build_app(async_engine, "fake", api_key=api_key, extra_routers=[router])
            transport = httpx.ASGITransport(app=app)
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                    return await fn(client)
            finally:
                await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

        return asyncio.run(asyncio.wait_for(main(), 40))

    return runner


async def complete(client, prompt: list[int], max_tokens: int, headers=None) -> None:
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, headers=headers)
    assert response.status_code == 200, response.text


async def settled_state(client) -> dict:
    """/dashboard/state once the engine's cached snapshot caught up with /v1/expert_load (engine idle).

    Both read the engine's one snapshot, refreshed at most every REFRESH_S: after a period with the engine
    idle, the next read refreshes it with every step done."""
    await asyncio.sleep(2 * REFRESH_S)
    for _ in range(200):
        fresh = (await client.get("/v1/expert_load")).json()
        state = (await client.get("/dashboard/state")).json()
        if state["expert_load"]["steps"] == fresh["steps"]:
            return state, fresh
        await asyncio.sleep(0.02)
    raise AssertionError("the dashboard's snapshot never caught up with /v1/expert_load")


def test_state_shows_what_v1_expert_load_reports():
    async def scenario(client):
        await asyncio.gather(*(complete(client, [5 + i, 9 + i], 12) for i in range(4)))
        return await settled_state(client)

    state, fresh = serve(RoutingFakeEngine(step_delay_s=0.001))(scenario)
    load = state["expert_load"]
    assert (load["num_layers"], load["num_experts"], load["num_slots"], load["num_ranks"]) == (3, 8, 10, 2)
    for key in ("counts", "rank_load", "balancedness", "max_over_mean", "placement", "window", "steps"):
        assert load[key] == fresh[key], key
    counts = torch.tensor(load["counts"])
    assert int(counts.sum()) == 3 * 2 * 4 * 12        # layers x top-2 x requests x tokens
    # derived views agree with the counts: replicas from the placement, slots split a replica's tokens evenly
    phy2log = torch.tensor(load["placement"])
    replicas = torch.tensor(load["replicas"])
    assert torch.equal(replicas, torch.stack([torch.bincount(row, minlength=8) for row in phy2log]))
    slot_load = torch.tensor(load["slot_load"], dtype=torch.float64)
    assert torch.allclose(slot_load.sum(1), counts.sum(1).double())
    per_rank = slot_load.view(3, 2, 5).sum(-1)
    assert torch.allclose(per_rank, torch.tensor(load["rank_load"], dtype=torch.float64))
    assert load["slot_rank"] == [0] * 5 + [1] * 5
    assert state["health"] == {"healthy": True, "detail": "ok", "degraded": False}


def test_timeline_records_token_rates_and_requests_while_traffic_flows():
    async def scenario(client):
        traffic = asyncio.gather(*(complete(client, [3, 4 + i], 40) for i in range(6)))
        states = []
        while not traffic.done():
            states.append((await client.get("/dashboard/state")).json())
            await asyncio.sleep(0.03)
        await traffic
        await asyncio.sleep(0.03)
        states.append((await client.get("/dashboard/state")).json())
        return states

    states = serve(RoutingFakeEngine(step_delay_s=0.01), sample_interval_s=0.02)(scenario)
    timeline = states[-1]["timeline"]
    assert len(timeline["t"]) >= 3 and timeline["t"] == sorted(timeline["t"])
    assert max(timeline["generation_tokens_per_s"]) > 0
    assert max(r[0] for r in timeline["running"]) > 0
    assert all(len(r) == 1 for r in timeline["running"])   # one DP worker in the fake engine
    # the rates integrate back to the tokens generated between the first and the last sample
    t, rates = timeline["t"], timeline["generation_tokens_per_s"]
    generated = sum(rate * (b - a) for rate, a, b in zip(rates[1:], t, t[1:]))
    first = states[0]["tokens"]["generation"]
    assert generated == pytest.approx(states[-1]["tokens"]["generation"] - first, rel=1e-6, abs=1e-6)
    b = [v for v in timeline["balancedness_mean"] if v is not None]
    assert b and all(0 < v <= 1 for v in b)


def test_trace_download_is_a_load_balancer_trace_holding_every_sampled_token(tmp_path):
    async def scenario(client):
        first = (await client.get("/dashboard/state")).json()   # the baseline sample
        for round_ in range(3):
            await complete(client, [7, 8 + round_], 10)
            await settled_state(client)
            await asyncio.sleep(0.03)
        response = await client.get("/dashboard/trace")
        fresh = (await client.get("/v1/expert_load")).json()
        return first, response, fresh

    first, response, fresh = serve(RoutingFakeEngine(step_delay_s=0.001), sample_interval_s=0.01)(scenario)
    assert response.status_code == 200
    assert re.match(r'attachment; filename="expert-load-trace-\d{8}-\d{6}\.json"',
                    response.headers["content-disposition"])
    path = tmp_path / "trace.json"
    path.write_text(response.text)
    trace = load_trace(path)
    assert (trace.num_layers, trace.num_experts, trace.num_slots, trace.num_ranks) == (3, 8, 10, 2)
    assert trace.steps.shape[0] >= 3              # one row per interval with tokens
    assert bool((trace.steps.sum((1, 2)) > 0).all())
    baseline = torch.tensor(first["expert_load"]["counts"])   # the window then = totals then (fewer steps than the window)
    assert torch.equal(trace.steps.sum(0) + baseline, torch.tensor(fresh["totals"]))
    body = response.json()
    assert len(body["interval_times"]) == len(body["engine_steps"]) == trace.steps.shape[0]
    assert body["engine_steps"] == sorted(body["engine_steps"])


def test_rebalance_now_returns_the_event_and_the_state_shows_it_with_the_new_placement():
    engine = RoutingFakeEngine(step_delay_s=0.001)

    async def scenario(client):
        await asyncio.gather(*(complete(client, [11, 12 + i], 16) for i in range(4)))
        before, _ = await settled_state(client)
        response = await client.post("/dashboard/rebalance")
        after, fresh = await settled_state(client)
        return before, response, after, fresh

    before, response, after, fresh = serve(engine)(scenario)
    assert before["rebalance"]["available"] and before["rebalance"]["events"] == []
    assert response.status_code == 200, response.text
    event = response.json()["event"]
    assert event == engine.events[0].to_dict() and event["trigger"] == "manual"
    assert event["experts_moved"] > 0 and event["balancedness_after"] > event["balancedness_before"]
    assert after["rebalance"]["events"] == [event]
    assert after["expert_load"]["placement"] == fresh["placement"] != before["expert_load"]["placement"]
    assert after["expert_load"]["placement"] == engine.recorder.placement.phy2log.tolist()


def test_rebalance_and_reads_take_the_api_key():
    async def scenario(client):
        refused_read = await client.get("/dashboard/state")
        read = await client.get("/dashboard/state", headers={"Authorization": "Bearer sesame"})
        refused = await client.post("/dashboard/rebalance")
        accepted = await client.post("/dashboard/rebalance", headers={"Authorization": "Bearer sesame"})
        return refused_read, read, refused, accepted

    refused_read, read, refused, accepted = serve(RoutingFakeEngine(), api_key="sesame")(scenario)
    assert refused_read.status_code == 401 and read.status_code == 200   # the expert load is not public
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert accepted.status_code == 200 and accepted.json()["event"]["index"] == 0


def test_rebalance_without_expert_load_is_501_and_the_state_says_why():
    async def scenario(client):
        return (await client.get("/dashboard/state")).json(), await client.post("/dashboard/rebalance")

    state, response = serve(FakeEngine())(scenario)
    assert state["expert_load"] is None
    assert not state["rebalance"]["available"] and "no expert-parallel load" in state["rebalance"]["reason"]
    assert response.status_code == 501 and response.json()["error"]["code"] == "rebalance_unavailable"


def test_an_engine_refusing_to_rebalance_is_409_with_its_reason():
    recorder = ExpertLoadRecorder(2, 4, 4, 1)

    async def scenario(client):
        return await client.post("/dashboard/rebalance")

    response = serve(FakeEngine(expert_load=recorder.snapshot()))(scenario)
    assert response.status_code == 409
    assert "nothing to rebalance" in response.json()["error"]["message"]


def test_an_engine_without_rebalance_now_is_501_and_events_are_not_available():
    class Minimal(FakeEngine):
        rebalance_now = None
        rebalance_events = None

    recorder = ExpertLoadRecorder(2, 4, 4, 2)

    async def scenario(client):
        return (await client.get("/dashboard/state")).json(), await client.post("/dashboard/rebalance")

    state, response = serve(Minimal(expert_load=recorder.snapshot()))(scenario)
    assert "has no rebalance_now()" in state["rebalance"]["reason"]
    assert response.status_code == 501


def test_a_dead_engine_is_reported_in_the_state_not_as_an_http_error():
    async def scenario(client):
        await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 50})
        return await client.get("/dashboard/state")

    response = serve(RoutingFakeEngine(die_at_step=3))(scenario)
    assert response.status_code == 200
    health = response.json()["health"]
    assert not health["healthy"] and "rank 1 died" in health["detail"]


def test_page_and_assets_are_served_locally():
    plotly_js = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js")).read_bytes()

    async def scenario(client):
        names = ("plotly.min.js", "dashboard.js", "dashboard.css", "../routes.py")
        return await client.get("/dashboard"), {n: await client.get(f"/dashboard/static/{n}") for n in names}

    page, assets = serve(FakeEngine())(scenario)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "/dashboard/static/plotly.min.js" in urls
    assert all(u.startswith("/dashboard") or u.startswith("data:") for u in urls), urls
    assert assets["plotly.min.js"].content == plotly_js
    assert assets["dashboard.js"].headers["content-type"].startswith("text/javascript")
    assert "https://" not in assets["dashboard.js"].text and "http://" not in assets["dashboard.js"].text
    assert assets["../routes.py"].status_code == 404


def test_load_view_counts_replicas_and_splits_their_tokens():
    phy2log = torch.tensor([[0, 1, 2, 0], [2, 1, 1, 0]])  # [L=2, P=4] on 2 ranks, 3 experts: one replica per layer
    placement = Placement.from_phy2log(phy2log, num_experts=3, num_ranks=2)
    recorder = ExpertLoadRecorder(2, 3, 4, 2, placement=placement)
    recorder.record(0, torch.tensor([[0, 1], [0, 2], [0, 1]]))  # [T=3, K=2]
    recorder.record(1, torch.tensor([[2, 2], [1, 2], [0, 0]]))
    recorder.end_step()
    view = load_view(recorder.snapshot())
    assert view["counts"] == [[3, 2, 1], [2, 1, 3]]
    assert view["replicas"] == [[2, 1, 1], [1, 2, 1]]
    assert view["slot_load"] == [[1.5, 2.0, 1.0, 1.5], [3.0, 0.5, 0.5, 2.0]]
    assert view["slot_rank"] == [0, 0, 1, 1] and view["slots_per_rank"] == 2
    assert view["rank_load"] == [[3.5, 2.5], [3.5, 2.5]]
    json.dumps(view, allow_nan=False)


def test_load_view_turns_undefined_balancedness_into_null():
    recorder = ExpertLoadRecorder(1, 2, 2, 2)
    snapshot = recorder.snapshot()
    snapshot.balancedness = torch.tensor([math.nan])
    assert load_view(snapshot)["balancedness"] == [None]


def test_timeline_rates_never_go_negative_and_columns_line_up():
    def stats(generated, prompt):
        return EngineStats([WorkerStats(0, 2, 1, 10, 4, 0), WorkerStats(1, 0, 0, 10, 10, 0)], prompt, generated)

    timeline = Timeline(max_samples=3)
    timeline.add(100.0, stats(0, 0), None, True)
    timeline.add(102.0, stats(50, 10), None, True)
    timeline.add(103.0, stats(5, 0), None, False)   # totals went back: an engine restarted
    timeline.add(104.0, stats(25, 4), None, True)
    columns = timeline.to_dict()
    assert columns["t"] == [102.0, 103.0, 104.0]
    assert columns["generation_tokens_per_s"] == [25.0, 0.0, 20.0]
    assert columns["prompt_tokens_per_s"] == [5.0, 0.0, 4.0]
    assert columns["running"] == [[2, 0]] * 3 and columns["kv_usage"][0] == [0.6, 0.0]
    assert columns["healthy"] == [True, False, True] and columns["balancedness_min"] == [None] * 3
