"""SIGTERM drains `moe-serve`: new requests get 503 with Retry-After, the requests already running finish
(for up to `--shutdown-timeout` seconds; those still running then end with an error), and it exits 0.

The engine side (`AsyncEngine.begin_drain`, `wait_until_idle`) and the app's answers are checked in
process on the fake engine; the whole sequence on a real `moe-serve` subprocess on a tiny checkpoint.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from server_harness import FakeEngine, ServerProcess, serve_in_process

from moe_runtime.errors import ShuttingDownError
from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.graceful_drain import GracefulDrain

pytestmark = pytest.mark.timeout(180)

LONG_CONTEXT = 4096   # a tiny checkpoint with room for a stream that lasts seconds on a CPU


def run(coro, timeout_s: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ---- in process: the engine and the app --------------------------------------------------------

def test_a_draining_engine_refuses_new_requests_and_finishes_running_ones():
    async_engine = AsyncEngine(FakeEngine(step_delay_s=0.005)).start()

    async def main():
        stream = await async_engine.submit("running", [1], SamplingParams(max_tokens=40))
        first = await stream.__anext__()
        async_engine.begin_drain()
        with pytest.raises(ShuttingDownError, match="shutting down") as refused:
            await async_engine.submit("new", [1], SamplingParams(max_tokens=1))
        idle = asyncio.create_task(async_engine.wait_until_idle())
        await asyncio.sleep(0.02)
        busy_meanwhile = not idle.done()
        outputs = [first] + [output async for output in stream]
        await asyncio.wait_for(idle, 5)
        return refused.value, busy_meanwhile, outputs

    try:
        refused, busy_meanwhile, outputs = run(main())
        assert async_engine.draining and async_engine.num_in_flight == 0
    finally:
        async_engine.shutdown()
    assert refused.retry_after_s >= 1
    assert busy_meanwhile   # idle only once the running request ended
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 40


def test_an_idle_engine_is_idle_at_once():
    async_engine = AsyncEngine(FakeEngine()).start()
    try:
        run(async_engine.wait_until_idle(), timeout_s=2)
    finally:
        async_engine.shutdown()


def test_a_draining_server_answers_503_with_retry_after():
    async def scenario(client, async_engine):
        async_engine.begin_drain()
        completion = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        streamed = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
        return completion, streamed, await client.get("/health"), await client.get("/v1/models")

    completion, streamed, health, models = serve_in_process(FakeEngine(), scenario)
    for refused in (completion, streamed):
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503 and health.json() == {"status": "draining"}   # load balancers look away
    assert models.status_code == 200


def test_the_drain_is_immediate_without_an_engine_with_timeout_0_and_on_a_second_signal():
    stops = []
    assert not GracefulDrain(5, stop=lambda: stops.append("now")).begin()   # still starting: no engine yet
    async_engine = AsyncEngine(FakeEngine(step_delay_s=0.005)).start()

    def stop() -> None:   # what serve's stop does to the engine
        stops.append(time.monotonic())
        async_engine.begin_shutdown()

    async def main():
        try:
            no_wait = GracefulDrain(0, stop=lambda: stops.append("now"))
            no_wait.serving(async_engine)
            assert not no_wait.begin() and not async_engine.draining
            drain = GracefulDrain(0.3, stop=stop)
            drain.serving(async_engine)
            stream = await async_engine.submit("long", [1], SamplingParams(max_tokens=10_000))
            began = time.monotonic()
            assert drain.begin() and async_engine.draining
            assert not drain.begin()   # a second SIGTERM: the caller stops at once
            with pytest.raises(ShuttingDownError, match="stopped before this request finished"):
                async for _ in stream:   # runs until the drain's time is out, then is cut
                    pass
            return began
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    began = run(main())
    assert len(stops) == 1 and 0.25 < stops[0] - began < 3


# ---- a real moe-serve --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("mixtral", max_position_embeddings=LONG_CONTEXT)


def server_args(checkpoint, *extra: str) -> list[str]:
    return ["--model", str(checkpoint), "--device", "cpu", "--kv-cache-memory", "16M", "--log-level", "info",
            *extra]


def stream_body(max_tokens: int) -> dict:
    return {"prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def wait_for_draining(base_url: str, timeout_s: float = 10) -> None:
    """SIGTERM reaches the server asynchronously: wait until /health says it drains."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = httpx.get(base_url + "/health", timeout=5)
        if response.status_code == 503 and response.json() == {"status": "draining"}:
            return
        time.sleep(0.01)
    raise AssertionError("/health never said draining after SIGTERM")


def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_and_exits_0(checkpoint):
    max_tokens = 1500   # a few seconds: well inside the default --shutdown-timeout
    server = ServerProcess(server_args(checkpoint)).start()   # the default --shutdown-timeout
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=stream_body(max_tokens)) as response:
            assert response.status_code == 200
            events = sse_events(response)
            first = next(events)
            assert first["choices"][0]["text"] is not None
            server.process.send_signal(signal.SIGTERM)
            wait_for_draining(server.base_url)
            refused = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                 timeout=10)
            rest = list(events)
        exit_code = server.process.wait(60)
    finally:
        server.stop()
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert rest[-1] == "[DONE]", rest[-3:]
    finish_reasons = [e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict) and e["choices"]]
    assert finish_reasons[-1] == "length"
    assert rest[-2]["usage"]["completion_tokens"] == max_tokens   # the whole answer, not a cut one
    assert exit_code == 0, server.tail()


def test_shutdown_timeout_cuts_a_long_stream_and_still_exits_0(checkpoint):
    server = ServerProcess(server_args(checkpoint, "--shutdown-timeout", "1", "--max-num-seqs", "1")).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=stream_body(LONG_CONTEXT - 64)) as response:
            events = sse_events(response)
            next(events)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = list(events)
            cut_after_s = time.monotonic() - signalled
        exit_code = server.process.wait(60)
    finally:
        server.stop()
    assert "[DONE]" not in rest, rest[-3:]
    assert rest[-1]["error"]["code"] == "shutting_down", rest[-1]   # the client is told why it was cut
    assert rest[-1]["error"]["message"] == "the server stopped before this request finished"
    assert 0.9 < cut_after_s < 6, cut_after_s
    assert exit_code == 0, server.tail()
