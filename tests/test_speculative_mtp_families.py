"""MTP speculative decoding beyond DeepSeek-V3 (tests/test_speculative_mtp.py), on tiny checkpoints whose MTP
tensors are named as the published ones:

- GLM-4.5 (`Glm4MoeForCausalLM`): DeepSeek-V3's module (enorm, hnorm, eh_proj, shared_head, model.layers.N.*)
  around a GLM-4.5 decoder block (GQA with partial rotary, q/k norm and q/k/v bias; routed and shared experts);
- Qwen3-Next (`Qwen3NextForCausalLM`): `mtp.fc`, `mtp.pre_fc_norm_*`, a gated full-attention MoE block
  `mtp.layers.0` and `mtp.norm`, drafting for a hybrid model whose linear layers' states roll back past the
  rejected drafts.

For each: the drafts after every step equal what transformers' own decoder layer and norms compute from the
module's definition, and greedy tokens equal transformers' without speculation (chunked prefill, prefix
caching). Under ep=2 with attention TP (GLM: dp_attn=1, the MTP block's heads split) and with DP attention
(Qwen3-Next: dp_attn=2) greedy tokens are unchanged.
"""
from __future__ import annotations

import pytest

from engine_helpers import greedy
from mtp_checkpoints import MtpReference, Qwen3NextMtpReference, run_checking_drafts
from test_speculative_mtp import K, MTP, PROMPTS
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """arch -> its tiny checkpoint with an MTP layer (GLM-4.5's with its own embedding and head copies)."""
    root = tmp_path_factory.mktemp("mtp_families")
    return {arch: write_mtp_checkpoint(tiny_checkpoint_factory(arch), root / arch, own_copies=True)
            for arch in ("glm4_moe", "qwen3_next")}


@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_next"])
def test_the_drafts_are_the_mtp_modules_and_greedy_tokens_are_unchanged(arch, mtp_checkpoint, greedy_oracle,
                                                                       tmp_path):
    path = mtp_checkpoint[arch]
    reference = MtpReference(path) if arch == "glm4_moe" else Qwen3NextMtpReference(path, tmp_path)
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   enable_prefix_caching=True))
    for index, prompt in enumerate(PROMPTS):
        core.add_request(str(index), prompt, greedy(NEW_TOKENS))
    seqs = list(core._sequences.values())
    compared = run_checking_drafts(core, reference, K)
    assert compared >= 6
    assert [seq.output_token_ids for seq in seqs] == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    worker = core.stats().workers[0]
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0
    core.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch, dp_attn", [("glm4_moe", 1), ("qwen3_next", 2)])
def test_mtp_under_expert_parallel(arch, dp_attn, mtp_checkpoint, greedy_oracle):
    with LLM(str(mtp_checkpoint[arch]), device="cpu", dtype="float32", speculative_config=MTP, ep=2,
             dp_attn=dp_attn, enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"
