"""Speculative decoding under pipeline parallelism: exact greedy tokens.

Every stage schedules the same prompt-lookup drafts, the verify rows (1 + d per sequence) run through both
stages, the last one scores and accepts, and every stage appends the accepted drafts and rolls back the
rejected ones in its own layers' K/V and recurrent states (`execution/pipeline.py`). A stage that kept a
rejected draft's K/V or state would change the tokens after it.

- MoE (Qwen3-MoE, 4 layers, 2 stages, 2 micro-batches) with chunked prefill and prefix caching: drafts both
  accepted and rejected (the counters say so), tokens equal transformers', every block given back;
- hybrid recurrent (Qwen3-Next, Gated DeltaNet and full attention layers on each stage): its random text
  rejects the drafts, so each verify step rolls every stage's states back, and the tokens still equal
  transformers';
- MTP (DeepSeek-V3, 3 layers, 2 stages): the layer drafts on the last stage, which holds the embedding for it
  and broadcasts its drafts; tokens equal transformers';
- refused by name: EAGLE-3 under --pp (its three aux layers sit on different stages), MTP with more than one
  rank per stage.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_helpers import greedy
from tiny_checkpoints import hf_greedy
from test_speculative_hybrid import NEW_TOKENS, NGRAM, PROMPTS, SETTINGS, spec_counts
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError
from moe_runtime.speculative.speculation import Speculation
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(600)


def test_what_pipeline_stages_cannot_draft_with_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match=r"'eagle3' with --pp > 1 is not built"):
        Speculation.for_engine({"method": "eagle3", "model": "head"}, 2, 64)
    assert Speculation.for_engine(NGRAM, 2, 64) is not None
    four_ranks = SimpleNamespace(ctx=SimpleNamespace(parallel=SimpleNamespace(world_size=4, pp_size=2)))
    with pytest.raises(InvalidRequestError, match=r"'mtp' with --pp > 1 and more than one rank per stage"):
        Speculation.for_engine({"method": "mtp"}, 2, 64, four_ranks)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_ngram_greedy_tokens_through_two_stages_equal_transformers(arch, tiny_checkpoint_factory, greedy_oracle):
    expected = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory(arch)), pp=2, pp_micro_batches=2, **SETTINGS) as llm:
        cold = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        warm = llm.generate(PROMPTS, greedy(NEW_TOKENS))     # prompts resumed from the prefix cache
        accepted, drafted = spec_counts(llm)
        workers = llm.engine.stats().workers
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert drafted > 0
    if arch == "qwen3_moe":
        assert 0 < accepted < drafted, "drafts were meant to be both accepted and rejected"
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"


@pytest.mark.slow
def test_mtp_drafts_on_the_last_stage_and_every_stage_verifies(tiny_checkpoint_factory, tmp_path):
    base = tiny_checkpoint_factory("deepseek_v3")
    path = write_mtp_checkpoint(base, tmp_path / "mtp", own_copies=False)   # the MTP layer reads the target's embedding
    settings = {**SETTINGS, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}
    with LLM(str(path), pp=2, pp_micro_batches=2, **settings) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == hf_greedy(base, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"
