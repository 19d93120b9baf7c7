"""AsyncEngine: outputs per step, aborts, the bounded queue, and engine death never leaving a request hanging."""
import asyncio

import pytest
from server_harness import FakeEngine

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig, QueueFullError
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def started(engine: FakeEngine, **config) -> AsyncEngine:
    return AsyncEngine(engine, AsyncEngineConfig(**config)).start()


def test_generate_yields_every_step_and_ends_finished():
    engine = FakeEngine()
    async_engine = started(engine)

    async def main():
        outputs = [o async for o in async_engine.generate("a", [10, 20], SamplingParams(max_tokens=5))]
        return outputs

    try:
        outputs = run(main())
    finally:
        async_engine.shutdown()
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert all(not o.finished for o in outputs[:-1])
    assert outputs[-1].token_ids == FakeEngine.expected_tokens([10, 20], 5)
    # merged or not, the new tokens of all outputs add up to the whole output
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    assert engine.shut_down


def test_concurrent_requests_each_get_their_own_tokens():
    async_engine = started(FakeEngine(max_running=3))

    async def one(i):
        outputs = [o async for o in async_engine.generate(f"r{i}", [i * 10], SamplingParams(max_tokens=4 + i))]
        return outputs[-1].token_ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        results = run(main())
    finally:
        async_engine.shutdown()
    assert results == [FakeEngine.expected_tokens([i * 10], 4 + i) for i in range(8)]


def test_invalid_request_is_raised_by_submit_and_the_engine_keeps_serving():
    async_engine = started(FakeEngine(vocab_size=100))

    async def main():
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            await async_engine.submit("bad", [5, 500], SamplingParams(max_tokens=2))
        outputs = [o async for o in async_engine.generate("good", [5], SamplingParams(max_tokens=2))]
        return outputs[-1]

    try:
        last = run(main())
    finally:
        async_engine.shutdown()
    assert last.token_ids == [6, 7]
    assert async_engine.num_unstarted == 0


def test_leaving_the_loop_early_aborts_the_request():
    engine = FakeEngine(step_delay_s=0.005)
    async_engine = started(engine)

    async def main():
        async for output in async_engine.generate("leaver", [1], SamplingParams(max_tokens=200)):
            if len(output.token_ids) >= 3:
                break
        for _ in range(200):
            if "leaver" in engine.aborted:
                return
            await asyncio.sleep(0.01)

    try:
        run(main())
    finally:
        async_engine.shutdown()
    assert engine.aborted == ["leaver"]
    assert not engine.has_unfinished()


def test_abort_from_outside_ends_the_stream_with_an_abort_output():
    async_engine = started(FakeEngine(step_delay_s=0.005))

    async def main():
        stream = await async_engine.submit("x", [1], SamplingParams(max_tokens=500))
        first = await stream.__anext__()
        async_engine.front.abort("x")
        rest = [o async for o in stream]
        return first, rest

    try:
        first, rest = run(main())
    finally:
        async_engine.shutdown()
    assert not first.finished
    assert rest[-1].finished and rest[-1].finish_reason == "abort"


def test_queue_full_rejects_beyond_max_queue():
    # one request runs at a time; the others wait for their first token
    async_engine = started(FakeEngine(max_running=1, step_delay_s=0.005), max_queue=2, retry_after_s=3)

    async def main():
        running = await async_engine.submit("run", [1], SamplingParams(max_tokens=400))
        await running.__anext__()  # it has started: no longer queued
        queued = [await async_engine.submit(f"q{i}", [1], SamplingParams(max_tokens=2)) for i in range(2)]
        with pytest.raises(QueueFullError) as info:
            await async_engine.submit("over", [1], SamplingParams(max_tokens=2))
        assert info.value.retry_after_s == 3
        assert async_engine.num_unstarted == 2
        async_engine.front.abort("run")
        for stream in queued:
            assert [o async for o in stream][-1].finished
        assert async_engine.num_unstarted == 0
        # room again
        return [o async for o in async_engine.generate("later", [1], SamplingParams(max_tokens=1))]

    try:
        outputs = run(main())
    finally:
        async_engine.shutdown()
    assert outputs[-1].finished


def test_giving_up_on_a_long_submission_leaves_the_engine_healthy_and_empty():
    """A long prompt's admission checks run in a worker thread; a caller that stops waiting for them leaves
    nothing behind (the request is never admitted), and aborting a running request empties the engine."""
    engine = FakeEngine(step_delay_s=0.1)
    async_engine = started(engine, offload_prompt_tokens=8)

    async def main():
        busy = await async_engine.submit("busy", [1], SamplingParams(max_tokens=10_000))
        await busy.__anext__()          # the engine now sleeps 0.1 s per step
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(async_engine.submit("impatient", [1] * 64, SamplingParams(max_tokens=10)), 0)
        async_engine.front.abort("busy")
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.has_unfinished():
                break
        return engine.has_unfinished(), [r.request_id for r in engine.waiting]

    try:
        unfinished, waiting = run(main())
        health = async_engine.front.health()
    finally:
        async_engine.shutdown()
    assert health.healthy, health.detail
    assert unfinished is False and waiting == []
    assert async_engine.num_unstarted == 0


@pytest.mark.parametrize("failure", ["die_at_step", "crash_at_step", "health_fails_at_step"])
def test_engine_death_ends_in_flight_requests_and_refuses_new_ones(failure):
    engine = FakeEngine(step_delay_s=0.002, **{failure: 5})
    async_engine = started(engine)

    async def consume(i):
        got = []
        with pytest.raises(EngineDeadError):
            async for output in async_engine.generate(f"r{i}", [i], SamplingParams(max_tokens=100)):
                got.append(output)
        return got

    async def main():
        results = await asyncio.gather(*(consume(i) for i in range(3)))
        with pytest.raises(EngineDeadError, match="not running"):
            await async_engine.submit("late", [1], SamplingParams(max_tokens=2))
        return results

    try:
        results = run(main())
        health = async_engine.front.health()
    finally:
        async_engine.shutdown()
    assert all(len(r) < 100 for r in results)
    assert not health.healthy
    expected = {"die_at_step": "rank 1 died", "crash_at_step": "fake engine bug",
                "health_fails_at_step": "rank 3 stopped answering"}[failure]
    assert expected in health.detail


def test_idle_engine_whose_health_fails_is_reported_dead():
    engine = FakeEngine(health_fails_at_step=0)
    async_engine = started(engine)
    try:
        async def main():
            for _ in range(200):
                if not async_engine.front.health().healthy:
                    return async_engine.front.health()
                await asyncio.sleep(0.01)

        health = run(main())
    finally:
        async_engine.shutdown()
    assert health is not None and "rank 3" in health.detail


def test_shutdown_ends_in_flight_requests_with_an_error():
    async_engine = started(FakeEngine(step_delay_s=0.005))

    async def main():
        stream = await async_engine.submit("long", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, async_engine.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="not running"):
            await async_engine.submit("after", [1], SamplingParams(max_tokens=2))

    run(main())


def test_stats_and_health_snapshots_follow_the_engine():
    engine = FakeEngine(max_running=1, step_delay_s=0.005)
    async_engine = started(engine)

    async def main():
        streams = [await async_engine.submit(f"s{i}", [1], SamplingParams(max_tokens=50)) for i in range(3)]
        await streams[0].__anext__()
        await asyncio.sleep(0.05)
        stats = async_engine.front.stats()
        for i in range(3):
            async_engine.front.abort(f"s{i}")
        return stats

    try:
        stats = run(main())
    finally:
        async_engine.shutdown()
    assert stats.running == 1 and stats.waiting == 2
    assert async_engine.expert_load() is None


def test_max_queue_must_be_positive():
    with pytest.raises(ValueError, match="max_queue"):
        AsyncEngineConfig(max_queue=0)


class CountingSnapshots(FakeEngine):
    def __init__(self):
        super().__init__()
        self.snapshots_taken = 0

    def load_snapshot(self):
        self.snapshots_taken += 1
        return self.snapshots_taken


def test_expert_load_is_refreshed_only_while_someone_asks():
    engine = CountingSnapshots()
    async_engine = started(engine, expert_load_refresh_s=0.01)

    async def main():
        await async_engine.submit("a", [1], SamplingParams(max_tokens=3))   # attached and running
        await asyncio.sleep(0.3)                  # nobody asked: only the snapshot taken when attached
        untouched = engine.snapshots_taken
        first = async_engine.expert_load()        # asked: refreshed (the fake answers at once)
        await asyncio.sleep(0.1)
        later = async_engine.expert_load()
        fresh = await async_engine.fresh_expert_load()
        return untouched, first, later, fresh

    try:
        untouched, first, later, fresh = run(main())
    finally:
        async_engine.shutdown()
    assert untouched == 1 and first == 2
    assert later > first    # stale after expert_load_refresh_s: asked again, refreshed again
    assert fresh > later    # taken on demand
