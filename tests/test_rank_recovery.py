"""A worker rank dies mid-generation: the other ranks re-form with a fresh process in its place (a layout whose DP
worker spans ranks restarts them all), and every request resumes from its tokens, with the tokens it would have
had (greedy and seeded sampling alike); recoveries are bounded; `max_rank_restarts=0` keeps the old end
(tests/test_worker_failure.py)."""
import os
import signal
import threading
import time

import pytest

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import EngineDeadError

NEW_TOKENS = 24


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


def _run(core: EngineCore, request_id: str, prompt, params, resumed=()) -> list[int]:
    core.add_request(request_id, prompt, params, resumed_token_ids=list(resumed))
    tokens = list(resumed)
    while core.has_unfinished():
        for delta in core.step():
            tokens.extend(delta.new_token_ids)
    return tokens


@pytest.mark.parametrize("params", [greedy(NEW_TOKENS), sampled(NEW_TOKENS, seed=11)], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_with_the_tokens_it_would_have_had(tiny_checkpoint_factory, params):
    """The core side: a request sent again with the first 9 of its tokens gives the same remaining ones."""
    core = EngineCore(EngineConfig(model=str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32"))
    try:
        whole = _run(core, "whole", PROMPTS[0], params)
        resumed = _run(core, "resumed", PROMPTS[0], params, resumed=whole[:9])
    finally:
        core.shutdown()
    assert len(whole) == NEW_TOKENS
    assert resumed == whole


def _kill_when_decoding(llm, rank: int, min_tokens: int) -> threading.Thread:
    """SIGKILL `rank` once some request has `min_tokens` tokens (read from the front's request states)."""
    pid = llm.engine.client.processes[rank].pid

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = list(llm.engine.outputs.requests.values())
            if any(len(state.token_ids) >= min_tokens for state in states):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def ep_llm(tiny_checkpoint_factory):
    llm = LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32", ep=2, dp_attn=2,
              num_redundant_experts=2)
    yield llm
    llm.shutdown()


def test_a_killed_rank_is_replaced_and_every_request_ends_as_it_would_have(ep_llm):
    """The other rank keeps its process and weights; a fresh process takes the killed rank's place and loads only
    its share, and the job is back at its layout."""
    params = [greedy(NEW_TOKENS), sampled(NEW_TOKENS, seed=5), greedy(NEW_TOKENS), sampled(NEW_TOKENS, seed=6)]
    prompts = PROMPTS[:4]
    before = [out.token_ids for out in ep_llm.generate(prompts, params)]
    old_pids = {rank: p.pid for rank, p in ep_llm.engine.client.processes.items()}
    killer = _kill_when_decoding(ep_llm, rank=1, min_tokens=4)
    after = ep_llm.generate(prompts, params)
    killer.join(5)
    assert [out.token_ids for out in after] == before
    assert all(out.finish_reason == "length" for out in after)
    stats = ep_llm.engine.stats().recovery
    assert (stats.lost_ranks, stats.recoveries, stats.reformations) == (1, 1, 1) and stats.resumed_requests >= 1, stats
    health = ep_llm.engine.health()
    assert stats.recovering is None and health.healthy and not health.degraded
    new_pids = {rank: p.pid for rank, p in ep_llm.engine.client.processes.items()}
    assert new_pids[0] == old_pids[0] and new_pids[1] != old_pids[1] and ep_llm.engine.shape.dp_size == 2
    assert [out.token_ids for out in ep_llm.generate(prompts, params)] == before   # the new job serves on


def _kill_mid_rebalance(llm, rank: int, prompts):
    """Start a rebalance, SIGKILL `rank` at once, and check the same greedy requests end as before; the rebalance's
    future (done by then: failed with the loss, or landed before it was seen)."""
    params = greedy(NEW_TOKENS)
    before = [out.token_ids for out in llm.generate(prompts, params)]
    rebalance = llm.engine.rebalance_now()
    os.kill(llm.engine.client.processes[rank].pid, signal.SIGKILL)
    assert [out.token_ids for out in llm.generate(prompts, params)] == before
    assert rebalance.done()
    return rebalance


def test_a_rank_killed_mid_rebalance_fails_the_rebalance_alone(ep_llm):
    """The rebalance in flight fails with the loss (the re-formed job plans from what its slots hold); the
    requests resume and end as they would have."""
    losses = ep_llm.engine.stats().recovery.lost_ranks
    rebalance = _kill_mid_rebalance(ep_llm, 0, PROMPTS[:2])
    assert ep_llm.engine.stats().recovery.lost_ranks == losses + 1
    if rebalance.exception() is not None:   # else it ended before the kill was seen
        assert isinstance(rebalance.exception(), EngineDeadError) and "rank 0" in str(rebalance.exception())


def test_restarts_are_bounded(tiny_checkpoint_factory):
    """Attention TP (a DP worker of two ranks) cannot lose one: the job restarts, new processes for every rank. A
    rank that dies every time ends the engine after `max_rank_restarts` recoveries, naming the loss."""
    llm = LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32", ep=2, dp_attn=1,
              max_rank_restarts=1)
    try:
        for expected_losses in (1, 2):
            old_pids = {p.pid for p in llm.engine.client.processes.values()}
            os.kill(llm.engine.client.processes[1].pid, signal.SIGKILL)
            if expected_losses == 1:
                assert llm.generate(PROMPTS[:2], greedy(4))   # restarted once, served
                assert not {p.pid for p in llm.engine.client.processes.values()} & old_pids
                assert llm.engine.stats().recovery.reformations == 0
            else:
                with pytest.raises(EngineDeadError, match="worker rank 1"):
                    llm.generate(PROMPTS[:2], greedy(4))
            assert llm.engine.stats().recovery.lost_ranks == expected_losses
        assert not llm.engine.health().healthy
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def ep4_llm(tiny_checkpoint_factory):
    """ep=4 with 4 redundant slots (3 per rank for 8 experts); a rebalance migrates one MoE layer per step."""
    llm = LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32", ep=4, dp_attn=4,
              num_redundant_experts=4, eplb_layers_per_step=1)
    yield llm
    llm.shutdown()


def test_the_others_keep_their_processes_and_a_replacement_restores_the_layout(ep4_llm):
    """ep=4 with 4 redundant slots: a rank killed mid-decode. The three others keep their processes and weights
    and re-form with a fresh process in its place (which loads only its share), the layout is back (4 DP workers,
    healthy, not degraded), and every request ends as it would have; a second loss is absorbed alike."""
    llm = ep4_llm
    params = [greedy(NEW_TOKENS), sampled(NEW_TOKENS, seed=5)] * 3
    prompts = (PROMPTS * 2)[:6]
    before = [out.token_ids for out in llm.generate(prompts, params)]
    for losses, victim in ((1, 2), (2, 0)):
        old_pids = {rank: p.pid for rank, p in llm.engine.client.processes.items()}
        killer = _kill_when_decoding(llm, rank=victim, min_tokens=4)
        after = llm.generate(prompts, params)
        killer.join(5)
        assert [out.token_ids for out in after] == before
        stats = llm.engine.stats().recovery
        assert (stats.lost_ranks, stats.recoveries, stats.reformations) == (losses, losses, losses), stats
        pids = {rank: p.pid for rank, p in llm.engine.client.processes.items()}
        assert {r: p for r, p in pids.items() if r != victim} == {r: p for r, p in old_pids.items() if r != victim}
        assert pids[victim] != old_pids[victim] and llm.engine.shape.dp_size == 4
        health = llm.engine.health()
        assert health.healthy and not health.degraded, health
    assert [out.token_ids for out in llm.generate(prompts, params)] == before


def test_a_rank_killed_mid_rebalance_leaves_survivors_on_what_their_slots_hold(ep4_llm):
    """Killed while a rebalance migrates (one layer per step): the rebalance fails or lands, the others plan
    from what their slots really hold (not the placement some of them may not have committed), and the
    requests end as they would have."""
    llm = ep4_llm
    reformations = llm.engine.stats().recovery.reformations
    _kill_mid_rebalance(llm, 3, PROMPTS[:4])
    assert llm.engine.stats().recovery.reformations == reformations + 1
    load = llm.engine.wait(llm.engine.expert_load())
    assert load.placement.shape[1] == 12 and all(set(row.tolist()) == set(range(8)) for row in load.placement)
