"""EAGLE-3 speculative decoding: a draft head from a checkpoint directory of its own, in the published
`LlamaForCausalLMEagle3` layout (tests/eagle3_checkpoints.py writes a tiny random one).

- the config: `{"method": "eagle3", "model": DIR}` (vLLM's names); the directory is required, and only eagle3
  takes one; the aux layers are the head config's `eagle_aux_hidden_state_layer_ids`, else vLLM's
  (2, L // 2, L - 3); a directory holding something else and `--cp` are refused by name;
- the drafts after every step equal the head's definition computed naively from its tensors and transformers'
  hidden states of the target (the inputs of the three aux layers through fc, the token embedding, one Llama
  layer over cat(embeds, hidden), the draft vocabulary mapped back through d2t), chained on its own output;
- greedy tokens equal transformers' without speculation, and the engine counts the drafts and acceptances;
- with the captured decode step (plain and verify steps captured) and with two-batch overlap (the step split in two
  micro-batches) the drafts are still the head's after every step: those steps keep the aux layers' inputs too;
- under ep=2 dp_attn=2 with an MoE target, with and without two-batch overlap, greedy tokens are unchanged.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3_checkpoints import Eagle3Reference, write_eagle3_head
from engine_helpers import greedy
from mtp_checkpoints import drafted_greedy_run, drafting_core, run_checking_drafts
from test_speculative_mtp import K, PROMPTS
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.eagle3 import eagle3_aux_layers
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.speculative.eagle3_loading import build_eagle3_drafter

pytestmark = pytest.mark.timeout(600)

AUX = [1, 2, 3]
NEW_TOKENS = 12


def eagle3(head) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}


def test_the_config_names_the_head_and_its_aux_layers():
    assert SpeculativeConfig.parse({"method": "eagle3", "model": "/heads/h"}).model == "/heads/h"
    with pytest.raises(InvalidRequestError, match="needs its draft head"):
        SpeculativeConfig.parse({"method": "eagle3"})
    with pytest.raises(InvalidRequestError, match="only it takes one"):
        SpeculativeConfig.parse({"method": "ngram", "model": "/heads/h"})
    assert SpeculativeConfig.drafter_kv_layers({"method": "eagle3", "model": "/heads/h"}) == 1
    assert eagle3_aux_layers(SimpleNamespace(), 32) == (2, 16, 29)
    stated = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [5, 1, 3]})
    assert eagle3_aux_layers(stated, 32) == (1, 3, 5)


@pytest.fixture(scope="module")
def llama_with_head(tiny_checkpoint_factory, tmp_path_factory):
    target = tiny_checkpoint_factory("llama", num_hidden_layers=4)
    return target, write_eagle3_head(target, tmp_path_factory.mktemp("eagle3") / "head", AUX)


@pytest.fixture(scope="module")
def llama_reference(llama_with_head):
    return Eagle3Reference(*llama_with_head)


@pytest.fixture(scope="module")
def moe_with_head(tiny_checkpoint_factory, tmp_path_factory):
    target = tiny_checkpoint_factory("qwen3_moe", num_hidden_layers=4)
    return target, write_eagle3_head(target, tmp_path_factory.mktemp("eagle3-moe") / "head", AUX)


def test_the_drafts_are_the_heads_and_greedy_tokens_are_unchanged(llama_with_head, llama_reference):
    target, head = llama_with_head
    outputs, worker = drafted_greedy_run(target, eagle3(head), llama_reference, PROMPTS, NEW_TOKENS)
    assert outputs == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0
    assert 0 <= worker.spec_accepted_tokens <= worker.spec_draft_tokens


def test_the_drafts_are_the_heads_after_captured_decode_steps(llama_with_head, llama_reference):
    """Plain and verify decode steps run through the traced graph (rows 1 + K <= 4: three buckets); the head reads
    the aux layers' inputs the graph returns, so its drafts after every step are still the reference's."""
    target, head = llama_with_head
    prompts = PROMPTS[:1]
    core = drafting_core(target, eagle3(head), prompts, NEW_TOKENS, enable_torch_compile=True,
                         torch_compile_backend="eager", torch_compile_max_bs=1 + K)
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, llama_reference, K) >= 2 * len(prompts)
    capture, worker = core.runner.capture.stats, core.worker_stats()
    core.shutdown()
    assert [seq.output_token_ids for seq in seqs] == hf_greedy(target, prompts, NEW_TOKENS)
    assert capture.disabled_reason is None
    assert capture.captured_verify_steps > 0 and capture.captured_steps > capture.captured_verify_steps
    assert worker.spec_draft_tokens > 0


def test_the_drafts_are_the_heads_under_two_batch_overlap(moe_with_head):
    """One rank with MoE layers splits every step in two micro-batches; the head reads both halves' aux rows, in
    row order (decode steps of several sequences put them in different halves)."""
    target, head = moe_with_head
    core = drafting_core(target, eagle3(head), PROMPTS, NEW_TOKENS, enable_two_batch_overlap=True)
    assert core.executor.overlaps_micro_batches()
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, Eagle3Reference(target, head), K) >= 2 * len(PROMPTS)
    worker = core.worker_stats()
    core.shutdown()
    assert [seq.output_token_ids for seq in seqs] == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0


def test_what_eagle3_cannot_draft_from_is_refused_by_name(llama_with_head):
    target, head = llama_with_head
    with pytest.raises(InvalidRequestError, match="not an EAGLE-3 head"):
        EngineCore(EngineConfig(model=str(target), device="cpu", dtype="float32", speculative_config=eagle3(target)))
    source = SimpleNamespace(target=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=128, num_hidden_layers=4)),
                             config=SimpleNamespace(cp=2, enable_two_batch_overlap=False),
                             runner=SimpleNamespace(capture=None))
    with pytest.raises(InvalidRequestError, match="'eagle3' with --cp is not built"):
        build_eagle3_drafter(source, str(head), K)


@pytest.mark.slow
@pytest.mark.parametrize("two_batch_overlap", [False, True], ids=["one-batch", "two-batch-overlap"])
def test_eagle3_under_expert_parallel_lock_step(moe_with_head, two_batch_overlap):
    target, head = moe_with_head
    with LLM(str(target), device="cpu", dtype="float32", speculative_config=eagle3(head), ep=2, dp_attn=2,
             enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4,
             enable_two_batch_overlap=two_batch_overlap) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"
