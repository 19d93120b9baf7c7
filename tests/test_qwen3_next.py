"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`), hybrid Gated DeltaNet + gated full
attention, give transformers' greedy tokens and prompt logprobs on one rank, with prefills in chunks of a few
tokens (the linear layers' states carried across chunks), under preemption (states rebuilt by recompute), with EP +
DP attention, attention TP (heads and states split) and two pipeline stages.

The tiny models have 4 layers (3 linear, 1 full) and prompts up to 40 tokens, several KV blocks; the state crosses
delta-rule chunk and step boundaries when prefills run in steps of 5 tokens. What is not supported yet is refused by name and tested here: context
parallelism (P/D moves the states with the KV: tests/test_pd_hybrid.py). Prefix caching with the linear layers' state snapshots: tests/test_qwen3_next_prefix_cache.py.
"""
from __future__ import annotations

import pytest

from lazy_engines import tiny_engine_pool
from engine_helpers import greedy
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from tiny_checkpoints import HFOracle
from moe_runtime.kernels.delta_rule import DEFAULT_CHUNK
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.engine.core import EngineCore
from moe_runtime.kv_blocks.kv_groups import KVCacheLayout
from moe_runtime.records.sequence import Sequence
from moe_runtime.layers.attention_span import AttentionSpan
from moe_runtime.layers.state_cache import LayerStateCache

ARCHS = ["qwen3_next", "qwen3_5_moe"]
NEW_TOKENS = 6
NUM_TOP = 3
PROMPTS = [  # each several KV blocks
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(37)],
    [(13 * i + 4) % 470 + 6 for i in range(17)],
]
LAYOUTS = {
    "one_rank": {},
    "small_chunks": dict(max_num_batched_tokens=5, enable_chunked_prefill=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # 4 key / 8 value heads and 8 query heads split in two
    "pp2": dict(pp=2),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
        yield get


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    def get(arch: str) -> list[list[int]]:
        tokens = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
        assert any(len(set(t)) > 2 for t in tokens), "oracle output is degenerate; the test would be weak"
        return tokens
    return get


def test_prefills_cross_chunk_boundaries_when_cut_into_steps():
    """A whole prompt here fits one delta-rule chunk (64, as fla and transformers use); the small-chunk layout cuts
    each prompt into steps of 5 tokens, so the state crosses many boundaries (kernels' own crossings:
    tests/test_delta_rule.py)."""
    assert max(map(len, PROMPTS)) < DEFAULT_CHUNK < 2 * max(map(len, PROMPTS))
    assert LAYOUTS["small_chunks"]["max_num_batched_tokens"] < min(map(len, PROMPTS))


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(arch, engines, expected, tiny_checkpoint_factory):
    outputs = engines(arch, "one_rank").generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected(arch)
    oracle = HFOracle(tiny_checkpoint_factory(arch))
    for prompt, output in zip(PROMPTS, outputs):
        assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(oracle, prompt), prompt, NUM_TOP)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_chunks_of_a_few_tokens_carries_the_states(arch, engines, expected):
    llm = engines(arch, "small_chunks")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)
    core = llm.core
    hits = core.block_manager.counters.hits
    [again] = llm.generate([PROMPTS[0]], greedy(NEW_TOKENS))   # its prefix resumes from a state snapshot
    assert again.token_ids == expected(arch)[0]
    assert core.block_manager.counters.hits > hits
    assert core.block_manager.states.num_free == core.block_manager.states.num_slots, "state slots leaked"


def test_preemption_rebuilds_the_states_by_recompute(tiny_checkpoint_factory, expected):
    path = str(tiny_checkpoint_factory("qwen3_next"))
    options = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4)
    probe = EngineCore(EngineConfig(model=path, **options))
    caches = probe.runner.caches
    state_bytes = sum(c.nbytes() for c in caches if isinstance(c, LayerStateCache))
    block_bytes = (probe.runner.cache_bytes() - state_bytes) // probe.block_manager.num_blocks
    # 8 blocks of 8 tokens beside the state slots: the longest request (40 + 24 tokens) fits alone, not four at once
    with LLM(path, kv_cache_memory=state_bytes + 8 * block_bytes, **options) as llm:
        core = llm.core
        assert core.block_manager.num_blocks == 8
        outputs = llm.generate(PROMPTS, greedy(24))
        assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert core.block_manager.states.num_free == 4
    assert [o.token_ids[:NEW_TOKENS] for o in outputs] == expected("qwen3_next")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_parallel_with_dp_attention_matches(arch, engines, expected):
    llm = engines(arch, "ep2_dp2")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_tensor_parallel_splits_heads_and_states(arch, engines, expected):
    assert [o.token_ids for o in engines(arch, "ep2_attention_tp2").generate(PROMPTS, greedy(NEW_TOKENS))] \
        == expected(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_parallel_stages_match(arch, engines, expected):
    assert [o.token_ids for o in engines(arch, "pp2").generate(PROMPTS, greedy(NEW_TOKENS))] == expected(arch)


@pytest.mark.parametrize("flag,options", [("--cp", dict(cp=2, ep=2))])
def test_context_parallelism_is_refused_by_name(flag, options):
    config = EngineConfig(model="unused", **options)
    with pytest.raises(EngineConfigError, match=flag):
        KVCacheLayout.plan([AttentionSpan()] * 4, config, state_layers=(0, 1, 2))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_instances_keep_state_slots(mode):
    """P/D moves the states with the KV (tests/test_pd_hybrid.py): both sides plan their state slots."""
    config = EngineConfig(model="unused", disaggregation_mode=mode)
    assert KVCacheLayout.plan([AttentionSpan()] * 4, config, state_layers=(0, 1, 2)).state_slots == config.max_num_seqs


def test_state_slots_follow_admission_and_release():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, state_slots=2)
    seqs = [Sequence(f"r{i}", list(range(6)), greedy(1), arrival=i) for i in range(3)]
    assert manager.admit(seqs[0]) and manager.admit(seqs[1])
    assert {seqs[0].kv.state_slot, seqs[1].kv.state_slot} == {0, 1}
    assert not manager.admit(seqs[2]) and seqs[2].kv.state_slot == -1 and not seqs[2].kv.block_table
    manager.free(seqs[0])                                  # finished or preempted: its slot goes back
    assert seqs[0].kv.state_slot == -1 and manager.admit(seqs[2]) and seqs[2].kv.state_slot >= 0
