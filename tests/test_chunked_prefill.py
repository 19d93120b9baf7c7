"""Chunked prefill: decodes and prefill chunks share each step under the token budget.

- attention (no model): a mixed batch (decodes, chunks attending to their cached context, whole
  prefills; GQA with and without a sliding window, MLA-style single latent head) equals dense causal
  attention over each whole sequence;
- the scheduler (no model): every running decode runs, prefill chunks fill the rest of the budget,
  a long prompt samples only after its last chunk, and a step is "decode" for the expert dispatch
  only when every sequence decodes;
- every architecture (MLA included, and Mistral with a sliding window shorter than the prompts):
  greedy tokens equal transformers' with budgets of 1, 7 and 64 tokens, prompts longer than the
  budget, and prefix caching on (a cold pass per budget, then a warm one). The expert-parallel layout
  is in test_cache_aware_routing.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import PROMPTS, greedy
from mixed_attention_cases import attend, mixed_attention_case
from tiny_checkpoints import HFOracle
from moe_runtime.kernels import get_kernels
from moe_runtime import LLM, SamplingParams
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.engine.scheduler import Scheduler, SchedulerConfig
from moe_runtime.records.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.timeout(600)

ARCHS = ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
         "deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
LONG = [(7 * i + 3) % 500 + 5 for i in range(70)]        # longer than budgets 7 and 64
NEW_TOKENS = 4


# ---- attention over a mixed batch ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["torch", "reference"])
@pytest.mark.parametrize("heads,kv_heads,window,shared_kv", [(8, 2, None, False), (8, 2, 6, False),
                                                              (4, 1, None, True)])
def test_a_mixed_batch_attends_like_dense_attention_over_each_whole_sequence(family, heads, kv_heads, window,
                                                                             shared_kv):
    case = mixed_attention_case(heads, kv_heads, window, shared_kv)
    split = case.batch.split_single_queries(window)
    assert split.single and split.multi, "the batch must mix both paths"
    if window is not None:   # a decode whose context exceeds the window runs in the decode kernel from its first key
        assert 0 in split.single and split.key_starts is not None
    torch.testing.assert_close(attend(get_kernels("cpu", family), case), case.expected, rtol=1e-5, atol=1e-5)


# ---- the scheduler ---------------------------------------------------------------------------------------
def running_decoder(request_id: str, arrival: int, manager: BlockManager) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=50), arrival=arrival)
    assert manager.admit(seq)
    seq.num_cached_tokens = 3
    seq.output_token_ids.append(4)                      # sampled, not computed yet: it decodes next
    return seq


def test_each_step_runs_every_decode_and_fills_the_budget_with_prefill_chunks():
    manager = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=True), manager)
    decoders = [running_decoder(f"d{i}", i, manager) for i in range(3)]
    for seq in decoders:
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    long = Sequence("long", list(range(20)), SamplingParams(max_tokens=5), arrival=10)
    scheduler.add(long)
    chunks = []
    for _ in range(4):
        batch = scheduler.schedule()
        assert batch.seqs[:3] == decoders and all(s.num_scheduled_tokens == 1 for s in decoders)
        assert batch.num_tokens <= 8 and batch.phase == "prefill"
        chunks.append(long.num_scheduled_tokens)
        assert long.samples_this_step == (sum(chunks) == 20)
        for seq in batch.seqs:
            seq.commit_scheduled_tokens()
        for seq in decoders:
            seq.output_token_ids.append(5)              # each decode sampled one more token
    assert chunks == [5, 5, 5, 5], "the budget left after three decodes, every step"
    long.output_token_ids.append(7)
    batch = scheduler.schedule()
    assert batch.phase == "decode" and batch.num_tokens == 4


def test_without_chunking_prefill_and_decode_steps_alternate_whole():
    manager = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), manager)
    long = Sequence("long", list(range(20)), SamplingParams(max_tokens=5), arrival=0)
    scheduler.add(long)
    batch = scheduler.schedule()
    assert batch.seqs == [long] and long.num_scheduled_tokens == 20 and long.samples_this_step


# ---- greedy parity, every architecture -------------------------------------------------------------------
def with_budget(llm: LLM, tokens: int) -> None:
    scheduler = llm.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_for_any_chunk_size(arch, tiny_checkpoint_factory):
    overrides = dict(sliding_window=8) if arch == "mistral" else {}
    path = tiny_checkpoint_factory(arch, **overrides)
    one, seven, sixty_four = [PROMPTS[0], PROMPTS[3]], [PROMPTS[1], LONG[:30]], PROMPTS + [LONG]
    every = PROMPTS + [LONG, LONG[:30]]
    expected = dict(zip(map(tuple, every), HFOracle(path).greedy(every, NEW_TOKENS)))
    with LLM(str(path), device="cpu", dtype="float32", block_size=4, enable_chunked_prefill=True,
             enable_prefix_caching=True) as llm:
        for budget, prompts in [(1, one), (7, seven), (64, sixty_four)]:   # each prompt longer than a chunk
            llm.engine.reset_prefix_cache()
            with_budget(llm, budget)
            got = [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
            assert got == [expected[tuple(p)] for p in prompts], f"budget {budget}"
        hits = llm.engine.stats().prefix_cache_hits
        warm = [o.token_ids for o in llm.generate(sixty_four, greedy(NEW_TOKENS))]
        assert llm.engine.stats().prefix_cache_hits > hits
        assert warm == [expected[tuple(p)] for p in sixty_four], "warm cache, budget 64"
        manager = llm.core.block_manager
        assert manager.num_free_blocks == manager.num_blocks
