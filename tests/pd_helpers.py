"""Driving a prefill engine and a decode engine by hand (the blocking `Engine` face), as the router would.

`prefill` runs a prompt on the prefill engine (its first token, its KV parked) and returns the
finished output with its `kv_handle`; `decode` hands that to the decode engine and steps both (the
prefill one takes the release) until the request finishes. `settle` steps both for a while so
releases and frees land; `free_blocks` reads an engine's free KV blocks (either kind of front).
"""
from __future__ import annotations

import os
import secrets
import time
from contextlib import contextmanager

import pytest

from moe_runtime.records.outputs import RequestOutput
from moe_runtime.sampling.params import SamplingParams

KV_SECRET = secrets.token_hex(32)   # the deployment's secret: 32 random bytes, as every shared key must be


@contextmanager
def kv_key_in_env():
    """The deployment's KV secret in the environment (every P/D engine of a test module shares it)."""
    saved = os.environ.get("MOE_RUNTIME_KV_KEY")
    os.environ["MOE_RUNTIME_KV_KEY"] = KV_SECRET
    try:
        yield KV_SECRET
    finally:
        if saved is None:
            os.environ.pop("MOE_RUNTIME_KV_KEY", None)
        else:
            os.environ["MOE_RUNTIME_KV_KEY"] = saved


@pytest.fixture(scope="module", autouse=True)
def kv_key():
    """The KV secret of a test module's P/D engines (autouse where a module imports it)."""
    with kv_key_in_env() as secret:
        yield secret


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_until(engines, request_id: str, timeout_s: float = 60.0) -> RequestOutput:
    """Step every engine until `request_id` finishes on one of them; its last output."""
    return run_all_until(engines, [request_id], timeout_s)[request_id]


def run_all_until(engines, request_ids: list[str], timeout_s: float = 60.0) -> dict[str, RequestOutput]:
    """Step every engine until each of `request_ids` finished on one of them; their last outputs."""
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(request_ids):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{sorted(set(request_ids) - set(done))} did not finish within {timeout_s}s")
        for engine in engines:
            done.update((output.request_id, output) for output in engine.step()
                        if output.request_id in request_ids and output.finished)
    return done


def prefill(p, request_id: str, prompt: list[int]) -> RequestOutput:
    p.add_request(request_id, prompt, greedy(1), export_kv=True)
    return run_until([p], request_id)


def decode(p, d, request_id: str, prompt: list[int], handle, max_tokens: int, params=None) -> RequestOutput:
    d.add_request(request_id, prompt, params or greedy(max_tokens), import_kv=handle)
    return run_until([d, p], request_id)


def settle(engines, seconds: float = 0.5) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for engine in engines:
            engine.step()
        time.sleep(0.01)


def free_blocks(engine) -> int:
    """Free KV blocks of the engine's DP workers, summed (as its ranks last reported them)."""
    return sum(worker.kv_blocks_free for worker in engine.stats().workers)


def wait_for_free(engines_and_counts: list, timeout_s: float = 15.0) -> None:
    """Step until each engine has its expected free-block count; fails with the counts seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = [free_blocks(engine) for engine, _ in engines_and_counts]
        if seen == [count for _, count in engines_and_counts]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"free KV blocks {seen}, expected {[c for _, c in engines_and_counts]}")
        settle([engine for engine, _ in engines_and_counts], 0.05)


def wait_for_blocks_and_slots(engines_and_counts: list) -> None:
    """`wait_for_free`, then every engine's recurrent-state slots back too (hybrid models, DeepSeek-V4)."""
    wait_for_free(engines_and_counts)
    for engine, _ in engines_and_counts:
        states = engine.core.block_manager.states
        assert states.num_free == states.num_slots, "a state slot leaked"
