"""The dashboard's plan view: /dashboard/plan answers with `moe-serve plan` for the served tiny model (its
layout's row marked), on `cpu` by default and on another GPU kind and count when asked, takes the API key as
the other dashboard routes do, and the page wires it (section, script, asset)."""
import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.planner.calibration.cpu_calibration import CpuNotCalibratedError, CpuRates, cpu_hardware
from moe_runtime.server import build_app
from moe_runtime.server.dashboard import dashboard_router

pytestmark = pytest.mark.timeout(120)


def fixed_cpu():
    """`--gpu cpu` without measuring this machine (the calibration bench's business): fixed rates."""
    return cpu_hardware(CpuRates("test", 2, 2e10, 4e10, 1e-5), overheads=None)


def uncalibrated_cpu():
    """A CPU server whose calibration was never run (the plan view must not measure it)."""
    raise CpuNotCalibratedError(Path("/nonexistent/cpu_calibration.json"))


def serve_tiny(path, api_key=None, cpu_loader=fixed_cpu):
    def runner(fn):
        async def main():
            engine_config = EngineConfig(model=str(path), device="cpu", dtype="float32",
                                         kv_cache_memory=4 * 2**20, max_num_seqs=8)
            async_engine = AsyncEngine(make_engine(engine_config), AsyncEngineConfig()).start()
            router = dashboard_router(api_key=api_key, plan_cpu_loader=cpu_loader, served_engine_config=engine_config)
            app = build_app(async_engine, "tiny", api_key=api_key, extra_routers=[router])
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                             timeout=60) as client:
                    return await fn(client)
            finally:
                await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

        return asyncio.run(asyncio.wait_for(main(), 100))

    return runner


@pytest.fixture(scope="module")
def tiny_moe(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


def test_plan_route_answers_for_the_served_model_on_cpu_and_on_an_asked_gpu(tiny_moe):
    async def scenario(client):
        default = await client.get("/dashboard/plan")
        asked = await client.get("/dashboard/plan", params=dict(gpu="h100", gpus_per_node=8, nodes=2,
                                                                prompt_len=128, output_len=32, concurrency=64))
        bad = await client.get("/dashboard/plan", params=dict(gpu="tpu9"))
        return default, asked, bad

    default, asked, bad = serve_tiny(tiny_moe)(scenario)
    assert default.status_code == 200, default.text
    plan = default.json()
    assert plan["model"] == str(tiny_moe) and plan["architecture"] == "Qwen3MoeForCausalLM"
    assert plan["gpu"] == "cpu" and plan["dtype"] == "float32" and plan["query"]["gpu"] == "cpu"
    assert plan["query"]["concurrency"] == 8                       # the served --max-num-seqs
    assert plan["explanation"].startswith("Winner") and plan["rows"][0]["runs"]
    served = [row for row in plan["rows"] if row["served"]]
    assert len(served) == 1 and served[0]["layout"] == plan["served_layout"] and served[0]["world"] == 1
    assert all("moe-serve " in row["command"] and f"--model {tiny_moe}" in row["command"]
               for row in plan["rows"] if row["runs"])

    assert asked.status_code == 200, asked.text
    other = asked.json()
    assert other["gpu"] == "h100" and other["gpus"] == 16
    assert (other["query"]["prompt_len"], other["query"]["output_len"], other["query"]["concurrency"]) == (128, 32, 64)
    assert "--device cuda" in other["rows"][0]["command"]
    assert max(row["world"] for row in other["rows"]) > 1          # layouts over several GPUs were planned

    assert bad.status_code == 400 and "tpu9" in bad.json()["error"]["message"]


def test_plan_route_takes_the_api_key_and_the_page_wires_it(tiny_moe):
    async def scenario(client):
        refused = await client.get("/dashboard/plan")
        accepted = await client.get("/dashboard/plan", headers={"Authorization": "Bearer sesame"})
        page = await client.get("/dashboard", headers={"Authorization": "Bearer sesame"})
        script = await client.get("/dashboard/static/plan.js", headers={"Authorization": "Bearer sesame"})
        return refused, accepted, page, script

    refused, accepted, page, script = serve_tiny(tiny_moe, api_key="sesame")(scenario)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert accepted.status_code == 200 and accepted.json()["rows"]
    assert page.status_code == 200 and 'id="plan"' in page.text and 'id="plan-table"' in page.text
    assert "/dashboard/static/plan.js" in re.findall(r'src="([^"]+)"', page.text)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "/dashboard/plan" in script.text and "https://" not in script.text


def test_an_uncalibrated_cpu_server_plans_for_a_gpu_table_and_says_how_to_calibrate(tiny_moe):
    async def scenario(client):
        return await client.get("/dashboard/plan"), await client.get("/dashboard/plan", params=dict(gpu="cpu"))

    default, asked = serve_tiny(tiny_moe, cpu_loader=uncalibrated_cpu)(scenario)
    assert default.status_code == 200, default.text
    plan = default.json()
    assert plan["gpu"] == plan["query"]["gpu"] == "h100" and plan["query"]["gpus_per_node"] == 8 and plan["rows"]
    assert "moe-serve plan --gpu cpu --calibrate" in plan["calibration"]
    assert asked.status_code == 400 and "--calibrate" in asked.json()["error"]["message"]   # asked for: an error


def test_the_plan_route_answers_within_its_bound(tiny_moe, monkeypatch):
    """A plan that takes too long is a 503 naming the bound, and the loop answers other routes meanwhile."""
    from moe_runtime.server.dashboard import routes

    released = threading.Event()

    def slow_plan(*args):
        released.wait(60)   # held past the bound until the test has its answers (not a fixed sleep to wait out)
        raise AssertionError("not reached in time")

    monkeypatch.setattr(routes, "served_plan", slow_plan)
    monkeypatch.setattr(routes, "PLAN_TIMEOUT_S", 0.5)

    async def scenario(client):
        try:
            plan = asyncio.create_task(client.get("/dashboard/plan"))
            started = time.monotonic()
            health = await client.get("/health")
            health_s = time.monotonic() - started
            return await plan, health, health_s
        finally:
            released.set()

    plan, health, health_s = serve_tiny(tiny_moe)(scenario)
    assert plan.status_code == 503 and "0.5" in plan.json()["error"]["message"], plan.text
    assert health.status_code == 200 and health_s < 0.5
