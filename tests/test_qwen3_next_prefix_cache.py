"""Prefix caching for hybrid linear-attention models (Qwen3-Next, Qwen3.5-MoE): a second request sharing a long
prefix resumes from the full layers' cached blocks and a state snapshot of its linear layers at the prefix's last
cached block boundary, and still gives transformers' greedy tokens; prompt logprobs skip the cache and match within
1e-4; a small snapshot pool or KV budget falls back to a shorter prefix or none; preemption, chunked prefill of a
few tokens per chunk and ep=2 dp_attn=2 stay exact.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from tiny_checkpoints import HFOracle
from moe_runtime.kernels.delta_rule import chunked_delta_rule, chunked_delta_rule_states
from moe_runtime import LLM
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.records.sequence import Sequence
from moe_runtime.kv_blocks.state_snapshots import StateSnapshots

ARCHS = ["qwen3_next", "qwen3_5_moe"]
NEW_TOKENS = 5
BLOCK = 8
SHARED = [(7 * i + 3) % 500 + 5 for i in range(35)]          # 4 full blocks of 8, then 3 tokens
PROMPTS = [SHARED + [11, 12, 13, 14, 15], SHARED + [21, 22, 23, 24, 25, 26, 27]]
BASE = dict(device="cpu", dtype="float32", block_size=BLOCK)


def run_one_by_one(llm: LLM, prompts, params) -> list:
    return [llm.generate([prompt], params)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    return lambda arch: greedy_oracle(arch, PROMPTS, NEW_TOKENS)


def hits(llm: LLM) -> int:
    return llm.core.block_manager.counters.hits


@pytest.mark.parametrize("arch", ARCHS)
def test_second_request_resumes_the_shared_prefix_and_matches(arch, tiny_checkpoint_factory, expected):
    with LLM(str(tiny_checkpoint_factory(arch)), **BASE) as llm:
        first = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))[0]
        assert hits(llm) == 0
        second = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))[0]
        assert hits(llm) == 4 * BLOCK, "the shared 4 blocks (and their state snapshot) were meant to be reused"
        assert [first.token_ids, second.token_ids] == expected(arch)
        manager = llm.core.block_manager
        assert manager.states.num_free == manager.states.num_slots


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_skip_the_cache_and_match(arch, tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory(arch)), **BASE) as llm:
        llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))
        [scored] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS, prompt_logprobs=3))
        assert hits(llm) == 0
    assert_prompt_logprobs_match(scored.prompt_logprobs,
                                 expected_logprobs(HFOracle(tiny_checkpoint_factory(arch)), PROMPTS[1]), PROMPTS[1], 3)


def test_a_one_snapshot_pool_falls_back_to_a_shorter_prefix_and_matches(tiny_checkpoint_factory, expected):
    """max_num_seqs=1: one slot, one snapshot; each step keeps the first boundary it crosses, so the second
    request resumes after one block, not four."""
    with LLM(str(tiny_checkpoint_factory("qwen3_next")), max_num_seqs=1, **BASE) as llm:
        assert llm.core.block_manager.snapshots.num_snapshots == 1
        outputs = run_one_by_one(llm, PROMPTS, greedy(NEW_TOKENS))
        assert 0 < hits(llm) < 4 * BLOCK
    assert [o.token_ids for o in outputs] == expected("qwen3_next")


def test_evicted_blocks_leave_no_hit_and_still_match(tiny_checkpoint_factory, expected):
    """A third, unrelated request evicts the shared blocks: the second one computes everything again."""
    other = [(13 * i + 4) % 470 + 6 for i in range(30)]
    with LLM(str(tiny_checkpoint_factory("qwen3_next")), max_num_seqs=2, **BASE) as llm:
        llm.core.block_manager.reset_prefix_cache()
        outputs = run_one_by_one(llm, [PROMPTS[0], other], greedy(NEW_TOKENS))
        llm.core.block_manager.reset_prefix_cache()
        [second] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
        assert hits(llm) == 0
    assert [outputs[0].token_ids, second.token_ids] == expected("qwen3_next")


def test_preemption_and_recompute_with_snapshots(tiny_checkpoint_factory, expected):
    """12 blocks of 8 tokens: both prompts are admitted (5 + 6 blocks), their 30 new tokens do not fit (9 + 9); the preempted one resumes
    from its own cached prefix and snapshot, or recomputes."""
    path = str(tiny_checkpoint_factory("qwen3_next"))
    probe = LLM(path, max_num_seqs=2, **BASE)
    runner = probe.core.runner
    state_bytes = sum(c.nbytes() for c in runner.caches if hasattr(c, "ssm"))
    block_bytes = (runner.cache_bytes() - state_bytes) // probe.core.block_manager.num_blocks
    probe.shutdown()
    with LLM(path, max_num_seqs=2, kv_cache_memory=state_bytes + 12 * block_bytes, **BASE) as llm:
        outputs = llm.generate(PROMPTS, greedy(30))
        core = llm.core
        assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert hits(llm) > 0
    assert [o.token_ids[:NEW_TOKENS] for o in outputs] == expected("qwen3_next")


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_of_a_few_tokens_captures_boundaries_inside_chunks(arch, tiny_checkpoint_factory, expected):
    with LLM(str(tiny_checkpoint_factory(arch)), max_num_batched_tokens=5, enable_chunked_prefill=True,
             **BASE) as llm:
        outputs = run_one_by_one(llm, PROMPTS, greedy(NEW_TOKENS))
        assert hits(llm) == 4 * BLOCK
    assert [o.token_ids for o in outputs] == expected(arch)


@pytest.mark.slow
def test_expert_parallel_with_dp_attention_hits_and_matches(tiny_checkpoint_factory, expected):
    with LLM(str(tiny_checkpoint_factory("qwen3_next")), ep=2, dp_attn=2, **BASE) as llm:
        outputs = run_one_by_one(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[1]], greedy(NEW_TOKENS))
    assert [o.token_ids for o in outputs] == expected("qwen3_next") + [expected("qwen3_next")[1]]


def test_snapshot_states_inside_a_chunk_equal_a_run_stopping_there():
    import torch
    torch.manual_seed(0)
    length, heads, dk, dv = 70, 2, 4, 3
    q, k = torch.randn(length, heads, dk), torch.nn.functional.normalize(torch.randn(length, heads, dk), dim=-1)
    v, g, beta = torch.randn(length, heads, dv), -torch.rand(length, heads), torch.rand(length, heads)
    state = torch.randn(heads, dk, dv)
    out, final, states = chunked_delta_rule_states(q, k, v, g, beta, state, [8, 64, 66], chunk=64)
    plain_out, plain_final = chunked_delta_rule(q, k, v, g, beta, state, chunk=64)
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)
    for offset, snapshot in zip([8, 64, 66], states):
        _, stopped = chunked_delta_rule(q[:offset], k[:offset], v[:offset], g[:offset], beta[:offset], state)
        torch.testing.assert_close(snapshot, stopped, rtol=1e-5, atol=1e-5)


def test_snapshots_are_readable_only_after_their_step_and_pending_ones_are_not_evicted():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, state_slots=1)
    snapshots: StateSnapshots = manager.snapshots
    first = Sequence("a", list(range(9)), greedy(1), arrival=0)
    assert manager.admit(first)
    first.num_scheduled_tokens = 9
    manager.schedule_tokens(first, 9)
    assert [position for position, _ in first.kv.state_captures] == [4]   # one row: the first boundary only
    second = Sequence("b", list(range(9)), greedy(1), arrival=1)
    assert manager._cached_prefix(second).blocks == [], "the snapshot is not written before its step ran"
    first.commit_scheduled_tokens()
    prefix = manager._cached_prefix(second)
    assert len(prefix.blocks) == 1 and prefix.restore == first.kv.state_captures[0][1] and not prefix.tier_hashes
    manager.free(first)
    assert snapshots.num_cached == 1
