"""Speculative decoding with attention heads split over ranks, exact greedy tokens (transformers' without it).

- EAGLE-3 on a dense model under `--tp 2` (Llama: every layer's heads and MLP split; the head is kept whole on both
  ranks, reads the target's aux hidden states, which every rank has whole, and drafts alike on both);
- n-gram under attention TP (ep=2, dp_attn=1: one DP worker whose two ranks split the heads) for a windowed model
  (gpt-oss: sliding-window groups rolled back past rejected drafts, drafts both accepted and rejected) and a
  recurrent hybrid (Qwen3-Next: each rank's Gated DeltaNet heads' states restored from their draft checkpoints).

MTP under `--tp` has no model to run: tp is for dense models and no built dense architecture has an MTP layer (MTP's
attention TP, ep=2 dp_attn=1, is in tests/test_speculative_mtp.py and test_speculative_mtp_families.py).
"""
from __future__ import annotations

import pytest

from eagle3_checkpoints import write_eagle3_head
from engine_helpers import greedy
from test_speculative_hybrid import PROMPTS as HYBRID_PROMPTS, SETTINGS, spec_counts
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

K = 3
PROMPTS = [HYBRID_PROMPTS[0], HYBRID_PROMPTS[2]]   # longer than gpt-oss's window; both draft, both accept some
NEW_TOKENS = 16


def test_eagle3_under_dense_tensor_parallel(tiny_checkpoint_factory, tmp_path):
    target = tiny_checkpoint_factory("llama", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head", [1, 2, 3])
    speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with LLM(str(target), tp=2, **{**SETTINGS, "speculative_config": speculative}) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        _, drafted = spec_counts(llm)
        worker = llm.engine.stats().workers[0]
    assert outputs == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert drafted > 0
    assert worker.kv_blocks_free == worker.kv_blocks_total, "blocks leaked"


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next"])
def test_ngram_under_attention_tensor_parallel(arch, tiny_checkpoint_factory, greedy_oracle):
    with LLM(str(tiny_checkpoint_factory(arch)), ep=2, dp_attn=1, **SETTINGS) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        accepted, drafted = spec_counts(llm)
        worker = llm.engine.stats().workers[0]
    assert outputs == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    assert drafted > 0
    if arch == "gpt_oss":      # the tiny Qwen3-Next's text never repeats its prompt: its drafts are all rejected
        assert 0 < accepted < drafted, "drafts were meant to be both accepted and rejected"
    assert worker.kv_blocks_free == worker.kv_blocks_total, "blocks leaked"
