"""MTP speculative decoding beyond DeepSeek-V3 (tests/test_speculative_mtp.py), on tiny checkpoints whose MTP
tensors are named as the published ones:

- GLM-4.5 (`Glm4MoeForCausalLM`): DeepSeek-V3's module (enorm, hnorm, eh_proj, shared_head, model.layers.N.*)
  around a GLM-4.5 decoder block (GQA with partial rotary, q/k norm and q/k/v bias; routed and shared experts);
- DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): the same module around a DeepSeek
  Sparse Attention block that runs a lightning indexer of its own (GLM-5's drawn from its last layer with an
  indexer, its last layer sharing one), over prompts longer than `index_topk`; an FP8 DeepSeek-V3.2 checkpoint
  drafts through the same loader, its MTP layer's indexer FP8 too;
- Qwen3-Next (`Qwen3NextForCausalLM`): `mtp.fc`, `mtp.pre_fc_norm_*`, a gated full-attention MoE block
  `mtp.layers.0` and `mtp.norm`, drafting for a hybrid model whose linear layers' states roll back past the
  rejected drafts.

For each: the drafts after every step equal what transformers' own decoder layer and norms compute from the
module's definition, and greedy tokens equal transformers' without speculation (chunked prefill of 8 tokens,
prefix caching). Under ep=2 with attention TP (GLM-4.5, GLM-5: dp_attn=1, the MTP block's heads split) and with DP
attention (Qwen3-Next: dp_attn=2) greedy tokens are unchanged. Refused by name: a Qwen3-Next or DeepSeek-V3.2 checkpoint
without its MTP tensors, more than one MTP layer, `--cp`.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_helpers import greedy
from fp8_checkpoints import write_fp8_checkpoint
from mtp_checkpoints import MtpReference, Qwen3NextMtpReference, drafted_greedy_run, drafting_core, run_checking_drafts
from test_speculative_mtp import K, MTP, PROMPTS
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.errors import InvalidRequestError
from moe_runtime.speculative.mtp_loading import build_mtp_drafter
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 12
ARCHS = ["glm4_moe", "qwen3_next", "deepseek_v32", "glm_moe_dsa"]
SPARSE = ("deepseek_v32", "glm_moe_dsa")
INDEX_TOPK = 8   # the tiny DeepSeek Sparse Attention models' (tests/tiny_archs.py)


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """arch -> its tiny checkpoint with an MTP layer (GLM-4.5's and GLM-5's with their own embedding and head
    copies, DeepSeek-V3.2's drafting through the target's)."""
    root = tmp_path_factory.mktemp("mtp_families")
    return {arch: write_mtp_checkpoint(tiny_checkpoint_factory(arch), root / arch, own_copies=arch != "deepseek_v32")
            for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_drafts_are_the_mtp_modules_and_greedy_tokens_are_unchanged(arch, mtp_checkpoint, greedy_oracle,
                                                                       tmp_path):
    path = mtp_checkpoint[arch]
    if arch in SPARSE:   # most rows have more tokens than they may attend to: the indexer's choice is tested
        assert sum(len(prompt) > 2 * INDEX_TOPK for prompt in PROMPTS) >= 2
    reference = Qwen3NextMtpReference(path, tmp_path) if arch == "qwen3_next" else MtpReference(path)
    outputs, worker = drafted_greedy_run(path, MTP, reference, PROMPTS, NEW_TOKENS)
    assert outputs == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0


def test_an_fp8_sparse_attention_checkpoint_drafts_with_its_mtp_layer(tiny_checkpoint_factory, tmp_path):
    """DeepSeek-V3.2's FP8 layout with its MTP layer (the block's indexer projections in FP8 blocks too): read
    through the same loader, dequantized; its drafts are those of the dequantized layer."""
    fp8, oracle = write_fp8_checkpoint(tiny_checkpoint_factory("deepseek_v32"), tmp_path / "fp8", tmp_path / "oracle",
                                       (32, 48), with_mtp=True, mtp_oracle_dir=tmp_path / "mtp-oracle")
    core = drafting_core(fp8, MTP, PROMPTS[:1], NEW_TOKENS)
    [seq] = core._sequences.values()
    assert run_checking_drafts(core, MtpReference(tmp_path / "mtp-oracle"), K) >= 3
    core.shutdown()
    assert seq.output_token_ids == hf_greedy(oracle, PROMPTS[:1], NEW_TOKENS)[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch, dp_attn", [("glm4_moe", 1), ("qwen3_next", 2), ("glm_moe_dsa", 1)])
def test_mtp_under_expert_parallel(arch, dp_attn, mtp_checkpoint, greedy_oracle):
    with LLM(str(mtp_checkpoint[arch]), device="cpu", dtype="float32", speculative_config=MTP, ep=2,
             dp_attn=dp_attn, enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        workers = llm.engine.stats().workers
    assert outputs == greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 for w in workers)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), "blocks leaked"


def fake_source(cfg, names: set[str], cp_size: int = 1) -> SimpleNamespace:
    """What `build_mtp_drafter` reads before it builds anything."""
    return SimpleNamespace(target=SimpleNamespace(hf_config=cfg), reader=SimpleNamespace(names=lambda: names,
                                                                                          directory="ckpt"),
                           ctx=SimpleNamespace(parallel=SimpleNamespace(cp_size=cp_size)))


def test_what_mtp_cannot_draft_with_is_refused_by_name():
    glm = SimpleNamespace(architectures=["Glm4MoeForCausalLM"], num_hidden_layers=3, num_nextn_predict_layers=1)
    qwen = SimpleNamespace(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4)
    with pytest.raises(InvalidRequestError, match="Qwen3NextForCausalLM.*mtp\\.\\*"):
        build_mtp_drafter(fake_source(qwen, {"model.embed_tokens.weight"}), K)
    v32 = SimpleNamespace(**{**vars(glm), "architectures": ["DeepseekV32ForCausalLM"]})   # built, but no tensors
    with pytest.raises(InvalidRequestError, match="DeepseekV32ForCausalLM.*model.layers.3.*built for .*GlmMoeDsa"):
        build_mtp_drafter(fake_source(v32, {"model.embed_tokens.weight"}), K)
    with pytest.raises(InvalidRequestError, match="--cp is not built"):
        build_mtp_drafter(fake_source(glm, {"model.layers.3.eh_proj.weight"}, cp_size=2), K)
    two = SimpleNamespace(**{**vars(glm), "num_nextn_predict_layers": 2})
    with pytest.raises(InvalidRequestError, match="num_nextn_predict_layers=2 is not built"):
        build_mtp_drafter(fake_source(two, {"model.layers.3.eh_proj.weight"}), K)
