"""The dashboard's KV-tier panel: each DP worker's tiers (occupancy, hits, loaded bytes) and its requests loading reach
/dashboard/state as the workers report them, the page carries the panel, and a headless Chromium draws one
occupancy bar per tier with the state's numbers (hidden while no worker has a tier)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from server_harness import FakeEngine

from moe_runtime.engine.stats import EngineStats, WorkerStats
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.kv_tiers.connector import TierCounters
from moe_runtime.server import build_app
from moe_runtime.server.dashboard import DashboardConfig, dashboard_router

pytestmark = pytest.mark.timeout(90)

GIB = 2**30


def tiers_of(dp_rank: int) -> list[TierCounters]:
    """Worker `dp_rank`'s host tier a quarter (dp0) or half (dp1) full, its disk tier an eighth."""
    host = TierCounters("host", capacity_bytes=4 * GIB, used_bytes=(dp_rank + 1) * GIB, entries=100 + dp_rank,
                        hits=40 + dp_rank, saved=300, saved_bytes=3 * GIB, loaded_bytes=(dp_rank + 2) * 2**20)
    disk = TierCounters("disk", capacity_bytes=64 * GIB, used_bytes=8 * GIB, entries=900 + dp_rank, hits=7 + dp_rank,
                        misses=1, saved=900, saved_bytes=8 * GIB, loaded_bytes=5 * 2**20, errors=2)
    return [host, disk]


class TieredFakeEngine(FakeEngine):
    """FakeEngine whose two DP workers report KV tiers (dp0 and dp1), or none (`tiers=False`)."""

    def __init__(self, tiers: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.tiers = tiers

    def stats(self) -> EngineStats:
        return EngineStats([WorkerStats(dp, 0, 0, 100, 100, 0, loading=dp + 2, kv_tier_hit_tokens=160 * (dp + 1),
                                        kv_tiers=tiers_of(dp) if self.tiers else []) for dp in (0, 1)])


def asgi_state(engine) -> dict:
    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        app = build_app(async_engine, "fake", extra_routers=[dashboard_router(config=DashboardConfig())])
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return (await client.get("/dashboard/state")).json()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_the_state_carries_each_workers_tiers_and_requests_loading():
    state = asgi_state(TieredFakeEngine())
    for dp, worker in enumerate(state["workers"]):
        assert (worker["dp_rank"], worker["loading"], worker["kv_tier_hit_tokens"]) == (dp, dp + 2, 160 * (dp + 1))
        assert [t["name"] for t in worker["kv_tiers"]] == ["host", "disk"]   # fastest first
        for shown, tier in zip(worker["kv_tiers"], tiers_of(dp)):
            for field in ("capacity_bytes", "used_bytes", "entries", "hits", "misses", "saved", "saved_bytes",
                          "loaded_bytes", "errors"):
                assert shown[field] == getattr(tier, field), (dp, tier.name, field)
            assert shown["occupancy"] == pytest.approx(tier.used_bytes / tier.capacity_bytes)


def test_a_worker_without_tiers_shows_an_empty_list():
    state = asgi_state(TieredFakeEngine(tiers=False))
    assert all(worker["kv_tiers"] == [] and worker["loading"] == dp + 2
               for dp, worker in enumerate(state["workers"]))


def test_the_page_carries_the_tier_panel_and_the_script_that_fills_it():
    async def main():
        async_engine = AsyncEngine(FakeEngine(), AsyncEngineConfig()).start()
        app = build_app(async_engine, "fake", extra_routers=[dashboard_router(config=DashboardConfig())])
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return ((await client.get("/dashboard")).text,
                        (await client.get("/dashboard/static/dashboard.js")).text)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    page, script = asyncio.run(asyncio.wait_for(main(), 60))
    assert 'id="kv-tiers"' in page and 'id="kv-tiers-workers"' in page
    assert "renderTiers(state.workers)" in script and "kv_tiers" in script


# ---- in a browser ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServedApp:
    """The app with the dashboard on `engine`, served by uvicorn on a thread of this process (a context manager)."""

    def __init__(self, engine):
        self.engine = engine
        self.port = free_port()
        self.server = None
        self.thread = None

    def __enter__(self) -> "ServedApp":
        ready = threading.Event()

        def serve():
            async def main():
                self.async_engine = AsyncEngine(self.engine, AsyncEngineConfig()).start()
                app = build_app(self.async_engine, "fake",
                                extra_routers=[dashboard_router(config=DashboardConfig(poll_interval_ms=200))])
                self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
                ready.set()
                try:
                    await self.server.serve()
                finally:
                    await asyncio.get_running_loop().run_in_executor(None, self.async_engine.shutdown)
            asyncio.run(main())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the app did not start"
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


TIER_ROWS_SCRIPT = """
return Array.from(document.querySelectorAll('#kv-tiers-workers .tier-worker')).map((block) => ({
  dp: Number(block.dataset.dpRank),
  summary: block.querySelector('.tier-summary').textContent,
  rows: Array.from(block.querySelectorAll('tr[data-tier]')).map((row) => ({
    tier: row.dataset.tier,
    bar: parseFloat(row.querySelector('.occupancy > span').style.width),
    cells: Array.from(row.querySelectorAll('td')).map((td) => td.textContent.trim()),
  })),
}));
"""


@pytest.mark.slow
@pytest.mark.parametrize("tiers", [True, False], ids=["tiers", "no-tiers"])
def test_a_browser_draws_one_occupancy_bar_per_tier_with_the_states_numbers(tiers):
    from browser_gate import require_browser
    require_browser()
    from test_dashboard_browser import CHROMIUM_FLAGS, console_errors, renders, wait_for
    from browser_gate import CHROMEDRIVER, CHROMIUM
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with ServedApp(TieredFakeEngine(tiers=tiers)) as served:
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            driver.get(served.url + "/dashboard")
            wait_for(driver, lambda d: renders(d) >= 2, what="two renders")
            hidden = driver.execute_script("return document.getElementById('kv-tiers').hidden")
            blocks = driver.execute_script(TIER_ROWS_SCRIPT)
            errors = console_errors(driver)
        finally:
            driver.quit()
    assert not [e for e in errors if "kv" in e["message"].lower() or "renderTiers" in e["message"]], errors
    if not tiers:
        assert hidden and blocks == []
        return
    assert not hidden
    assert [b["dp"] for b in blocks] == [0, 1]
    for block in blocks:
        dp = block["dp"]
        assert f"{dp + 2} request(s) loading" in block["summary"]
        assert f"{160 * (dp + 1)} prompt tokens" in block["summary"]
        assert [r["tier"] for r in block["rows"]] == ["host", "disk"]
        for row, tier in zip(block["rows"], tiers_of(dp)):
            assert row["bar"] == pytest.approx(100 * tier.used_bytes / tier.capacity_bytes, abs=0.05)
            name, _, used, entries, hits, loaded, errors_shown = row["cells"]
            assert (name, entries, hits, errors_shown) == (tier.name, str(tier.entries), str(tier.hits),
                                                           str(tier.errors))
            assert used.endswith(f"/ {tier.capacity_bytes // GIB}.0 GiB")
            assert loaded == f"{tier.loaded_bytes / 2**20:.1f} MiB"
