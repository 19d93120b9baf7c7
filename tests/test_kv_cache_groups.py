"""KV cache groups: windowed layers (a sliding window beside full layers) keep only the blocks their queries can
still read, in a pool of their own; every scheduler feature and layout keeps transformers' greedy tokens.

The model: a tiny Qwen2 of four layers, the upper two sliding over 8 tokens (`use_sliding_window`,
`max_window_layers=2`), blocks of 4 tokens, prompts up to five windows long."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import greedy, runtime_prefill_logits
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.kv_blocks.kv_groups import KVCacheLayout, KVGroups, window_pool_blocks
from moe_runtime.records.sequence import Sequence
from moe_runtime.kv_blocks.window_blocks import FREED, WindowBlocks
from moe_runtime.front.llm import LLM
from moe_runtime.layers.attention_span import CHUNKED, SLIDING, AttentionSpan
from moe_runtime.sampling.params import SamplingParams
from tiny_checkpoints import HFOracle
from window_watch import window_blocks_held

WINDOW, BLOCK = 8, 4
HELD_BOUND = -(-WINDOW // BLOCK) + 1          # ceil(W / block_size) + 1
LAYER_TOKEN_BYTES = 4 * (16 + 16) * 4         # one layer's K and V of one token: 4 KV heads of 16, fp32
PROMPTS = [list(range(5, 45)), list(range(100, 123)), list(range(7, 45)), [300, 301, 302]]
NEW_TOKENS = 20


# ---------------------------------------------------------------------------------------- spans and groups
def test_spans_say_which_keys_a_query_reads():
    assert [AttentionSpan(SLIDING, 8).first_needed(p) for p in (0, 7, 8, 20)] == [0, 0, 1, 13]
    assert [AttentionSpan(CHUNKED, 8).first_needed(p) for p in (0, 7, 8, 20)] == [0, 0, 8, 16]
    assert AttentionSpan().first_needed(100) == 0
    with pytest.raises(ValueError, match="needs a size"):
        AttentionSpan(SLIDING)


def test_windowed_layers_form_groups_beside_the_full_ones():
    sliding, chunked, full = AttentionSpan(SLIDING, 8), AttentionSpan(CHUNKED, 16), AttentionSpan()
    groups = KVGroups.of_layers([full, sliding, chunked, sliding, full])
    assert [(g.span, g.layers) for g in groups.groups] == [(full, (0, 4)), (sliding, (1, 3)), (chunked, (2,))]
    assert groups.group_of_span(chunked) == 2 and groups.group_of_span(full) == 0
    assert not KVGroups.of_layers([sliding, sliding]).hybrid        # no full layer: one group, masks apply windows
    assert not KVGroups.of_layers([full, full]).hybrid


def test_a_window_pool_holds_every_sequence_window_and_a_step():
    # 4 sequences x (ceil(8/4) + 2) blocks + a 16-token step
    assert window_pool_blocks(AttentionSpan(SLIDING, 8), 4, max_num_seqs=4, max_num_batched_tokens=16) == 4 * 4 + 4


# ---------------------------------------------------------------------------------------- block bookkeeping
def test_a_long_generation_holds_at_most_its_window_in_a_windowed_group():
    window = WindowBlocks(AttentionSpan(SLIDING, WINDOW), num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    table: list[int] = []
    window.prepare(table, 0, 13)                                # a 13-token prefill: blocks 0..3
    assert WindowBlocks.held(table) == 4
    for position in range(13, 200):                             # then one token a step
        window.prepare(table, position, position + 1)
        assert WindowBlocks.held(table) <= HELD_BOUND, (position, table)
        held = [i for i, block in enumerate(table) if block != FREED]
        assert held[0] * BLOCK <= position - WINDOW + 1 and held[-1] == position // BLOCK   # what it reads
    window.release(table)
    assert window.pool.num_free_blocks == 16 and table == []


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, greedy(4), arrival=0)


def test_a_cached_prefix_is_reused_only_as_far_as_its_window_is_cached():
    manager = BlockManager(32, BLOCK, enable_prefix_caching=True, windows=((AttentionSpan(SLIDING, WINDOW), 12),))
    first = seq(list(range(30)), "first")
    assert manager.admit(first)
    manager.schedule_tokens(first, 30)                          # computed: blocks 0..6 full, registered
    first.num_cached_tokens = 30
    manager.free(first)
    again = seq(list(range(30)) + [77], "again")
    assert manager.admit(again)
    assert again.num_cached_tokens == 28                        # 7 full blocks, the window before 28 cached
    assert [i for i, b in enumerate(again.kv.window_tables[0]) if b != FREED] == [5, 6]   # keys 21..27
    manager.free(again)
    # evict the windowed block 6 (its pool's least recently used idle blocks go first when memory is needed)
    window = manager.windows[0]
    taken = [window.pool.take() for _ in range(window.pool.num_free_blocks)]
    for block in taken:
        window.pool.release(block)
    third = seq(list(range(30)) + [78], "third")
    assert manager.admit(third)
    assert third.num_cached_tokens == 0                         # no cached window left: computed from the start


def test_the_full_group_alone_decides_admission():
    manager = BlockManager(4, BLOCK, windows=((AttentionSpan(SLIDING, WINDOW), 3),))
    long = seq(list(range(17)))                                 # 5 full blocks: more than there are
    assert not manager.admit(long) and long.kv.block_table == [] and long.kv.window_tables == []


# ---------------------------------------------------------------------------------------- engine parity
@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=2)
    oracle = HFOracle(path)
    return path, oracle, oracle.greedy(PROMPTS, NEW_TOKENS)


def generate(path, prompts=PROMPTS, **layout) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, **layout)
    return [out.token_ids for out in llm.generate(prompts, greedy(NEW_TOKENS))], llm


@pytest.mark.parametrize("layout", [
    dict(),                                                     # chunked prefill + prefix caching (defaults)
    dict(max_num_batched_tokens=12),                            # prefills in chunks shorter than the window
    dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    # 20 full blocks beside the window pool of 4 sequences and 16-token steps: requests are preempted
    dict(max_num_seqs=4, max_num_batched_tokens=16,
         kv_cache_memory=(21 + 20) * BLOCK * LAYER_TOKEN_BYTES * 2),
], ids=["defaults", "small_chunks", "no_chunks_no_cache", "preemption"])
def test_greedy_tokens_equal_transformers(hybrid, layout):
    path, _, want = hybrid
    got, llm = generate(path, **layout)
    with llm:
        core = llm.core
        assert [w.span for w in core.block_manager.windows] == [AttentionSpan(SLIDING, WINDOW)]
        assert got == want
        again = [out.token_ids for out in llm.generate(PROMPTS, greedy(NEW_TOKENS))]   # prefix hits, if cached
        assert again == want
        if "kv_cache_memory" in layout:
            assert core.scheduler.num_preemptions > 0
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        assert all(w.pool.num_free_blocks == w.num_blocks for w in core.block_manager.windows)


def test_a_repeated_prompt_reuses_its_cached_prefix_and_window(hybrid):
    path, _, want = hybrid
    with LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK) as llm:
        first = llm.generate(PROMPTS[:1], greedy(NEW_TOKENS))[0].token_ids
        hits_before = llm.core.block_manager.counters.hits
        second = llm.generate(PROMPTS[:1], greedy(NEW_TOKENS))[0].token_ids
        assert first == second == want[0]
        assert llm.core.block_manager.counters.hits - hits_before >= len(PROMPTS[0]) - BLOCK


def test_a_sequence_holds_at_most_its_window_over_a_long_generation(hybrid):
    path, _, _ = hybrid
    with LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK) as llm, \
            window_blocks_held(llm.core) as held:
        out = llm.generate([PROMPTS[0]], greedy(60))[0]
        assert len(out.token_ids) == 60
        decode_steps = held[-59:]
        assert max(decode_steps) <= HELD_BOUND, decode_steps


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_layouts_keep_the_tokens(hybrid, layout):
    path, _, want = hybrid
    got, llm = generate(path, **layout)
    with llm:
        assert got == want


def test_prompt_logprobs_equal_transformers(hybrid):
    path, oracle, _ = hybrid
    prompt = PROMPTS[0]
    with torch.no_grad():
        reference = oracle.model(torch.tensor([prompt])).logits[0].log_softmax(-1)     # [T, V]
    with LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=12) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    got = [entry.logprob for entry in out.prompt_logprobs[1:]]
    want = [float(reference[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize("flags, named", [(dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
                                          (dict(cp=2), "--cp")])
def test_what_windowed_groups_do_not_support_yet_is_refused_by_name(flags, named):
    spans = [AttentionSpan(), AttentionSpan(SLIDING, WINDOW)]
    with pytest.raises(EngineConfigError, match=rf"{named} .*windowed KV cache groups \(sliding 8\)"):
        KVCacheLayout.plan(spans, EngineConfig(model="unused", **flags))
    assert KVCacheLayout.plan(spans[:1], EngineConfig(model="unused", **flags)).window_blocks == ()
