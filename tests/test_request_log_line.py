"""`moe-serve` logs one info line per finished API call: its id, outcome, prompt/completion tokens, latency."""
import asyncio
import logging
import re

import httpx
import pytest
from server_harness import FakeEngine

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app

pytestmark = pytest.mark.timeout(60)

LINE = re.compile(r"request (?P<id>\S+): (?P<outcome>\S+), (?P<prompt>\d+) prompt \+ (?P<completion>\d+) "
                  r"completion tokens, \d+\.\d{3} s")


def post_completions(bodies: list[dict]) -> list[httpx.Response]:
    """POST each body to /v1/completions of the app over a fake engine, in order."""

    async def main():
        async_engine = AsyncEngine(FakeEngine(), AsyncEngineConfig()).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "fake"))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                return [await client.post("/v1/completions", json=body) for body in bodies]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 30))


def request_lines(caplog) -> list[re.Match]:
    return [LINE.fullmatch(r.getMessage()) for r in caplog.records
            if r.name == "moe_runtime.server.generation" and r.levelno == logging.INFO]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_one_line_per_request_with_its_tokens(caplog, stream):
    caplog.set_level(logging.INFO, logger="moe_runtime.server.generation")
    responses = post_completions([{"prompt": [1, 2, 3], "max_tokens": 5, "stream": stream},
                                  {"prompt": [4, 5], "max_tokens": 2, "n": 2, "stream": stream}])
    assert [r.status_code for r in responses] == [200, 200]
    lines = request_lines(caplog)
    assert all(lines), [r.getMessage() for r in caplog.records]
    assert [(m["outcome"], m["prompt"], m["completion"]) for m in lines] == [("length", "3", "5"),
                                                                            ("length", "2", "4")]
    assert all(m["id"].startswith("cmpl-") for m in lines)


def test_a_refused_request_logs_no_request_line(caplog):
    caplog.set_level(logging.INFO, logger="moe_runtime.server.generation")
    response, = post_completions([{"prompt": [1, 10**6], "max_tokens": 2}])   # outside the fake vocabulary
    assert response.status_code == 400
    assert request_lines(caplog) == []
