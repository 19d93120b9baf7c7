"""EAGLE-3 speculative decoding: a draft head from a checkpoint directory of its own, in the published
`LlamaForCausalLMEagle3` layout (tests/eagle3_checkpoints.py writes a tiny random one).

- the config: `{"method": "eagle3", "model": DIR}` (vLLM's names); the directory is required, and only eagle3
  takes one; the aux layers are the head config's `eagle_aux_hidden_state_layer_ids`, else vLLM's
  (2, L // 2, L - 3); a directory holding something else, a captured decode step, `--cp` and two-batch
  overlap are refused by name;
- the drafts after every step equal the head's definition computed naively from its tensors and transformers'
  hidden states of the target (the inputs of the three aux layers through fc, the token embedding, one Llama
  layer over cat(embeds, hidden), the draft vocabulary mapped back through d2t), chained on its own output;
- greedy tokens equal transformers' without speculation, and the engine counts the drafts and acceptances;
- under ep=2 dp_attn=2 with an MoE target greedy tokens are unchanged.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3_checkpoints import Eagle3Reference, write_eagle3_head
from engine_helpers import greedy
from mtp_checkpoints import drafted_greedy_run
from test_speculative_mtp import K, PROMPTS
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.eagle3 import eagle3_aux_layers
from moe_runtime.speculative.config import SpeculativeConfig
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


def test_the_drafts_are_the_heads_and_greedy_tokens_are_unchanged(llama_with_head):
    target, head = llama_with_head
    reference = Eagle3Reference(target, head)
    outputs, worker = drafted_greedy_run(target, eagle3(head), reference, PROMPTS, NEW_TOKENS)
    assert outputs == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0
    assert 0 <= worker.spec_accepted_tokens <= worker.spec_draft_tokens


def test_what_eagle3_cannot_draft_from_is_refused_by_name(llama_with_head):
    target, head = llama_with_head
    with pytest.raises(InvalidRequestError, match="not an EAGLE-3 head"):
        EngineCore(EngineConfig(model=str(target), device="cpu", dtype="float32", speculative_config=eagle3(target)))
    with pytest.raises(InvalidRequestError, match="'eagle3' with enable_torch_compile is not built"):
        EngineCore(EngineConfig(model=str(target), device="cpu", dtype="float32", speculative_config=eagle3(head),
                                enable_torch_compile=True))
    target_cfg = SimpleNamespace(hidden_size=128, num_hidden_layers=4)
    for flag, config in (("--cp", SimpleNamespace(cp=2, enable_two_batch_overlap=False)),
                         ("--enable-two-batch-overlap", SimpleNamespace(cp=1, enable_two_batch_overlap=True))):
        source = SimpleNamespace(target=SimpleNamespace(hf_config=target_cfg), config=config,
                                 runner=SimpleNamespace(capture=None))
        with pytest.raises(InvalidRequestError, match=f"'eagle3' with {flag} is not built"):
            build_eagle3_drafter(source, str(head), K)


@pytest.mark.slow
def test_eagle3_under_expert_parallel_lock_step(tiny_checkpoint_factory, tmp_path):
    target = tiny_checkpoint_factory("qwen3_moe", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head", AUX)
    with LLM(str(target), device="cpu", dtype="float32", speculative_config=eagle3(head), ep=2, dp_attn=2,
             enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == hf_greedy(target, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"
