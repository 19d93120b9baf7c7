"""/metrics and /v1/expert_load read a shared expert-load snapshot: concurrent scrapes all succeed, and the
ranks see at most one snapshot command per refresh period, however many scrapes arrive."""
import asyncio
import concurrent.futures
import threading
import time

import httpx
import pytest
from server_harness import FakeEngine

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app
from moe_runtime.server.metrics import parse_samples
from test_server_metrics import snapshot_with_rank_loads

pytestmark = pytest.mark.timeout(60)

SCRAPERS = 8
SCRAPES_EACH = 10


class CountingSnapshots(FakeEngine):
    """Counts the snapshot commands the ranks would see; answers each `answer_after_s` later, from a thread
    (as the ranks answer between steps), so concurrent callers overlap with one in flight."""

    def __init__(self, answer_after_s: float):
        super().__init__(expert_load=snapshot_with_rank_loads(3, 1))
        self.answer_after_s = answer_after_s
        self.commands: list[float] = []   # monotonic time of each snapshot command

    def expert_load(self) -> concurrent.futures.Future:
        self.commands.append(time.monotonic())
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Timer(self.answer_after_s, future.set_result, args=(self.load_snapshot(),)).start()
        return future


def serve(engine, scenario, refresh_s: float):
    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig(expert_load_refresh_s=refresh_s)).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "fake"), raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                return await scenario(client)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 40))


async def scrape_repeatedly(client, path: str, times: int) -> list[httpx.Response]:
    responses = []
    for _ in range(times):
        responses.append(await client.get(path))
    return responses


def test_concurrent_scrapes_all_succeed_and_share_one_snapshot_per_period():
    engine = CountingSnapshots(answer_after_s=0.05)
    refresh_s = 0.25

    async def scenario(client):
        started = time.monotonic()
        paths = ["/metrics"] * (SCRAPERS - 2) + ["/v1/expert_load"] * 2
        batches = await asyncio.gather(*(scrape_repeatedly(client, path, SCRAPES_EACH) for path in paths))
        while time.monotonic() - started < 1.0:   # keep scraping for a second: several refresh periods pass
            batches.append(await scrape_repeatedly(client, "/metrics", 1))
            await asyncio.sleep(0.01)
        return [r for batch in batches for r in batch], time.monotonic() - started

    responses, elapsed = serve(engine, scenario, refresh_s)
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert len(responses) >= SCRAPERS * SCRAPES_EACH
    metrics = [parse_samples(r.text) for r in responses if r.request.url.path == "/metrics"]
    assert all('moe_expert_balancedness{layer="0"}' in m for m in metrics)   # every scrape has the load
    # one command when attached, then at most one per period (each waits for the previous one's answer)
    assert 1 <= len(engine.commands) <= 2 + elapsed / refresh_s, engine.commands
    gaps = [b - a for a, b in zip(engine.commands, engine.commands[1:])]
    assert all(gap >= refresh_s * 0.9 for gap in gaps), gaps


def test_a_burst_of_scrapes_inside_one_period_sends_no_command_at_all():
    engine = CountingSnapshots(answer_after_s=0.0)

    async def scenario(client):
        await client.get("/metrics")          # attaches: the snapshot taken then
        taken = len(engine.commands)
        responses = await asyncio.gather(*(client.get("/metrics") for _ in range(80)))
        return taken, responses

    taken, responses = serve(engine, scenario, refresh_s=3600.0)
    assert all(r.status_code == 200 for r in responses)
    assert len(engine.commands) == taken == 1
