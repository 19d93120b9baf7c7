"""AsyncEngine over worker ranks: the loop itself takes in every rank message (no engine thread).

One 2-rank engine for the module, attached to one event loop for its lifetime (as in moe-serve).
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from engine_helpers import PROMPTS, greedy
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.sampling.params import SamplingParams
from tiny_checkpoints import hf_greedy

NEW_TOKENS = 10


class LoopThread:
    """One event loop in a thread for the whole module: tests submit coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def setup(checkpoint):
    # max_rank_restarts=0: the module's last test holds the end of an engine that does not restart its ranks
    # (tests/test_rank_recovery.py and tests/test_server_rank_death.py hold the restart)
    engine = make_engine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2,
                                      max_rank_restarts=0))
    async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=64)).start()
    loop = LoopThread()
    yield async_engine, loop
    async_engine.shutdown()
    loop.stop()


async def collect(async_engine, request_id, prompt, params):
    return [output async for output in async_engine.generate(request_id, prompt, params)]


def kv_free(async_engine) -> int:
    return sum(w.kv_blocks_free for w in async_engine.front.stats().workers)


def test_concurrent_streams_get_their_greedy_tokens_with_no_engine_thread(setup, checkpoint):
    async_engine, loop = setup
    expected = hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)

    async def scenario():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p, greedy(NEW_TOKENS))
                                      for i, p in enumerate(PROMPTS)))

    results = loop.run(scenario())
    assert [r[-1].token_ids for r in results] == expected
    assert all(sum(len(o.new_token_ids) for o in r) == NEW_TOKENS for r in results)
    assert async_engine._loop is loop.loop
    assert not any(t.name == "engine-loop" for t in threading.enumerate())


def test_abort_and_stop_strings_free_the_ranks_kv_blocks(setup):
    async_engine, loop = setup
    start = kv_free(async_engine)

    async def scenario():
        stream = await async_engine.submit("long", PROMPTS[1], greedy(300))
        async for output in stream:
            if len(output.token_ids) >= 3:
                break
        async_engine.front.abort("long")
        probe = [o async for o in async_engine.generate("probe", PROMPTS[0], greedy(6))]
        text = probe[-1].text
        stop = text[len(text) // 2:][:3] or text
        stopped = [o async for o in async_engine.generate(
            "stopped", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop]))]
        return stopped[-1]

    final = loop.run(scenario())
    assert final.finish_reason == "stop" and len(final.token_ids) < 200
    deadline = time.monotonic() + 10
    while kv_free(async_engine) != start:  # the ranks report their blocks after the aborts
        assert time.monotonic() < deadline, f"KV blocks not released: {kv_free(async_engine)} vs {start}"
        time.sleep(0.05)


def test_expert_load_is_taken_on_the_loop(setup):
    async_engine, loop = setup
    snapshot = loop.run(async_engine.fresh_expert_load())
    assert snapshot is not None and int(snapshot.totals.sum()) > 0


def test_a_killed_rank_ends_every_stream_at_once(setup):
    """Last in the module: kills a rank. The loop sees the process exit (its sentinel), not a timeout."""
    async_engine, loop = setup
    engine = async_engine.front

    async def scenario():
        death = asyncio.ensure_future(async_engine.wait_until_dead())
        stream = await async_engine.submit("doomed", PROMPTS[1], greedy(400))
        first = await stream.__anext__()
        await asyncio.sleep(0.1)
        assert not death.done()
        os.kill(engine.client.processes[1].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        return first, time.monotonic() - started, await asyncio.wait_for(death, 5)

    first, waited, why = loop.run(scenario())
    assert first.new_token_ids and waited < 5 and "rank 1" in why
    health = async_engine.front.health()
    assert not health.healthy and "rank 1" in health.detail
