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
  and broadcasts its drafts; tokens equal transformers', with one rank per stage and with two (--ep 2
  --dp-attn 2: two DP workers, the MTP layer's experts spread over the last stage's two ranks, which run its
  pass and chain in lock-step among themselves, each broadcasting its worker's drafts to its first-stage peer);
- EAGLE-3 (Llama, 4 layers, aux layers 1, 2, 3 on both stages): the first stage hands the input of layer 1 on
  beside its activations, the head drafts on the last stage; tokens equal transformers', with one rank per
  stage and under dense tensor parallelism (--tp 2: the embedding the head reads split over the last stage's
  ranks); the stages' activation widths agree;
- a model drafter under --pp still needs the engine's model (refused by name without it).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3_checkpoints import Eagle3Reference, write_eagle3_head
from engine_helpers import greedy
from mtp_checkpoints import MtpReference
from multirank import ranks  # noqa: F401  (pytest fixture)
from speculative_pipeline_cases import DraftedRun, drafted_on_rank
from tiny_checkpoints import hf_greedy
from test_speculative_hybrid import NEW_TOKENS, NGRAM, PROMPTS, SETTINGS, spec_counts
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.decoder import CausalLM
from moe_runtime.speculative.speculation import Speculation
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(600)

MTP = {"method": "mtp", "num_speculative_tokens": 3}
DRAFTED_TOKENS = 12   # the drafts are checked after every step on every rank: fewer tokens than NEW_TOKENS


def test_model_drafters_under_pipeline_stages_need_the_model():
    assert Speculation.for_engine(NGRAM, 2, 64) is not None
    for raw in ({"method": "mtp"}, {"method": "eagle3", "model": "head"}):
        with pytest.raises(InvalidRequestError, match="needs the engine's model to draft with"):
            Speculation.for_engine(raw, 2, 64)


def test_each_stage_receives_the_aux_layers_inputs_kept_before_it():
    """What stage s receives is what stage s - 1 sends: the residual stream and the kept inputs of the aux layers
    before s (layers 0-3 over stages [0, 2), [2, 3), [3, 4) with aux layers 1, 2, 3: 2H, then 3H)."""
    hidden, aux = 8, (1, 2, 3)
    widths = [CausalLM.stage_activation_width(SimpleNamespace(hf_config=SimpleNamespace(hidden_size=hidden),
                                                              aux_layers=aux, first_layer=first))
              for first in (0, 2, 3)]
    assert widths == [hidden, 2 * hidden, 3 * hidden]


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


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """DeepSeek-V3 with an MTP layer that reads the target's embedding and head (their copies not stored)."""
    return write_mtp_checkpoint(tiny_checkpoint_factory("deepseek_v3"), tmp_path_factory.mktemp("mtp") / "mtp",
                                own_copies=False)


@pytest.mark.slow
def test_mtp_drafts_on_the_last_stage_and_every_stage_verifies(mtp_checkpoint, greedy_oracle):
    settings = {**SETTINGS, "speculative_config": MTP}
    with LLM(str(mtp_checkpoint), pp=2, pp_micro_batches=2, **settings) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == greedy_oracle("deepseek_v3", PROMPTS, NEW_TOKENS)   # the target without its MTP layer
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"


def check_drafted_runs(runs: list[DraftedRun], layout: dict, expected: list[list[int]]) -> None:
    """Every rank of a DP worker emitted the same tokens, together the expected ones; every rank checked drafts
    (the first stage's: those the last stage broadcast), and the last stage's counters show them verified."""
    tokens = {}
    for run in runs:
        for index, emitted in run.tokens.items():
            assert tokens.setdefault(index, emitted) == emitted, f"the ranks of prompt {index}'s worker disagree"
    assert [tokens[i] for i in range(len(expected))] == expected
    assert all(run.compared > 0 for run in runs), "every rank was to check drafts"
    last_stage = runs[len(runs) - len(runs) // layout["pp"]:]
    assert all(run.drafted > 0 and run.verify_steps > 0 for run in last_stage), "each worker was to verify drafts"


@pytest.mark.slow
def test_mtp_under_stages_of_two_ranks_drafts_the_layers_drafts(ranks, mtp_checkpoint, greedy_oracle):
    """--ep 2 --dp-attn 2 per stage: two DP workers, the MTP layer's experts spread over the last stage's two ranks
    (its pass and chain in lock-step among them, an idle worker's empty steps included); each last-stage rank
    broadcasts its worker's drafts to its first-stage peer."""
    layout, prompts = dict(pp=2, ep=2, dp_attn=2), PROMPTS[:3]   # worker 1's one prompt ends first: empty steps
    runs = ranks(4).run(drafted_on_rank, str(mtp_checkpoint), MTP, MtpReference, (mtp_checkpoint,), prompts,
                        DRAFTED_TOKENS, timeout_s=600, **layout)
    check_drafted_runs(runs, layout, greedy_oracle("deepseek_v3", prompts, DRAFTED_TOKENS))


@pytest.fixture(scope="module")
def llama_with_head(tiny_checkpoint_factory, tmp_path_factory):
    """A 4-layer Llama, an EAGLE-3 head reading the inputs of layers 1, 2, 3 (stage 0 holds layer 1, stage 1 the
    others), and the target's greedy tokens."""
    target = tiny_checkpoint_factory("llama", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path_factory.mktemp("eagle3") / "head", [1, 2, 3])
    return target, head, hf_greedy(target, PROMPTS, DRAFTED_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, tp=2)], ids=["pp2", "pp2-tp2"])
def test_eagle3_drafts_on_the_last_stage_from_aux_layers_on_both(ranks, layout, llama_with_head):
    """The first stage hands layer 1's input on beside its activations; under --tp 2 the last stage's ranks hold
    the embedding the head reads split between them."""
    target, head, expected = llama_with_head
    speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    runs = ranks(2 * layout.get("tp", 1)).run(drafted_on_rank, str(target), speculative, Eagle3Reference,
                                              (target, head), PROMPTS, DRAFTED_TOKENS, timeout_s=600, **layout)
    check_drafted_runs(runs, layout, expected)
