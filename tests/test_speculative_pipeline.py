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
- a model drafter (MTP, EAGLE-3) under --pp is refused by name.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from test_speculative_hybrid import NEW_TOKENS, NGRAM, PROMPTS, SETTINGS, spec_counts
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError
from moe_runtime.speculative.speculation import Speculation

pytestmark = pytest.mark.timeout(600)


def test_a_model_drafter_under_pipeline_stages_is_refused_by_name():
    for method in ({"method": "mtp"}, {"method": "eagle3", "model": "head"}):
        with pytest.raises(InvalidRequestError, match=r"--pp > 1 is not built"):
            Speculation.for_engine(method, 2, 64)
    assert Speculation.for_engine(NGRAM, 2, 64) is not None


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
