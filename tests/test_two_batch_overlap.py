"""Two-batch overlap end to end: greedy tokens equal transformers' (so equal to TBO off) in the EP layouts.

Each engine runs its steps as two interleaved micro-batches (`enable_two_batch_overlap=True`, all_to_all
dispatch on gloo, transfers really in flight), ep=2, qwen3_moe (GQA) and deepseek_v3 (MLA, a dense first
layer, shared experts):
- dp_attn=2 (each rank its own DP worker), chunked prefill (chunks of <= 16 tokens beside running decodes): a
  full batch, then one request alone (the other DP worker idle: two empty micro-batches on its rank; the busy
  one: one empty micro-batch), then requests ending at different steps;
- dp_attn=1 (attention TP 2): a full batch, and prompts sharing a prefix in one step (the later one reads KV
  blocks the earlier one writes in that step, from the other micro-batch).
Tokens cannot tell whether the steps were split at all; the one-rank test below checks that the option makes
the forward pass interleave two micro-batches, and that its logits are TBO off's.
"""
import pytest
import torch

import moe_runtime.models.decoder
from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM
from moe_runtime.records.sequence import Sequence
from moe_runtime.moe.stages import interleave
from moe_runtime.server.cli import build_parser, engine_config_from_args

NEW_TOKENS = 12
LAYOUTS = [("qwen3_moe", 2), ("qwen3_moe", 1), ("deepseek_v3", 2), ("deepseek_v3", 1)]   # (arch, dp_attn), ep=2
SHARED = list(range(40, 80))   # a 40-token prefix: two full KV blocks of 16
PREFIX_PROMPTS = [SHARED + [5, 6, 7], SHARED + [9, 10, 11, 12, 13], [300, 301, 302]]


@pytest.fixture(scope="module")
def oracle(greedy_oracle):
    return lambda arch, prompts: greedy_oracle(arch, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch, dp_attn", LAYOUTS, ids=[f"{a}-ep2-dp{d}" for a, d in LAYOUTS])
def test_two_batch_overlap_keeps_greedy_tokens(arch, dp_attn, tiny_checkpoint_factory, oracle):
    path = tiny_checkpoint_factory(arch)
    budget = {"max_num_batched_tokens": 16} if dp_attn == 2 else {}
    with LLM(str(path), device="cpu", dtype="float32", ep=2, dp_attn=dp_attn, enable_two_batch_overlap=True,
             **budget) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == oracle(arch, PROMPTS)
        if dp_attn == 2:
            [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
            assert single.token_ids == oracle(arch, PROMPTS)[1]
            lengths = [3, 12, 1, 7]
            mixed = llm.generate(PROMPTS, [greedy(n) for n in lengths])
            assert [o.token_ids for o in mixed] == [t[:n] for t, n in zip(oracle(arch, PROMPTS), lengths)]
        else:
            outputs = llm.generate(PREFIX_PROMPTS, greedy(NEW_TOKENS))
            assert [o.token_ids for o in outputs] == oracle(arch, PREFIX_PROMPTS)
            hits = sum(w.prefix_cache_hits for w in llm.engine.stats().workers)
            assert hits > 0, "no prefix was reused: the case proves nothing"


def prefill_logits(core, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position logits [B, V] of one prefill step of `prompts`, through the core's runner (KV blocks freed)."""
    seqs = [Sequence(f"p{i}", list(p), greedy(1), arrival=-1) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.block_manager.allocate(seq)
        seq.num_scheduled_tokens = len(seq.prompt_token_ids)
    try:
        inputs = core.runner.prepare(seqs)
        with torch.inference_mode():
            hidden = core.model(inputs.input_ids, inputs.positions, inputs.batch, core.runner.caches)
            return core.model.logits(hidden[inputs.last_token_index])
    finally:
        for seq in seqs:
            core.block_manager.free(seq)


def test_the_option_splits_the_forward_pass_and_keeps_its_logits(tiny_checkpoint_factory, monkeypatch):
    calls = []

    def counted(first, second):
        calls.append(1)
        return interleave(first, second)

    monkeypatch.setattr(moe_runtime.models.decoder, "interleave", counted)
    with LLM(str(tiny_checkpoint_factory("deepseek_v3")), device="cpu", dtype="float32",
             enable_two_batch_overlap=True, enable_prefix_caching=False) as llm:
        core = llm.core
        assert core.executor.two_batch_overlap and core.executor.overlaps_micro_batches()
        split = prefill_logits(core, PROMPTS)
        assert len(calls) == 1, "two-batch overlap is on, but the forward pass did not interleave micro-batches"
        core.executor.two_batch_overlap = False
        whole = prefill_logits(core, PROMPTS)
        assert len(calls) == 1
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)


def test_the_flag_reaches_the_engine_config():
    config = engine_config_from_args(build_parser().parse_args(["--enable-two-batch-overlap", "--ep", "2"]))
    assert config.enable_two_batch_overlap
    assert not engine_config_from_args(build_parser().parse_args([])).enable_two_batch_overlap
