"""DeepSeek-V4 as released (FP8 block linears with e8m0 scales, FP4 routed experts: tests/v4_release_checkpoints.py)
loads as it ships: every tensor reads back exactly as its dequantized twin (whose FP4 and FP8 pairs transformers' own
dequantizer reads the same), greedy tokens equal transformers' on the twin on one rank, and `--quantization mxfp4`
keeps the experts' released bytes (MXFP4's layout) and (slow) gives the same tokens with EP and DP attention, each
rank holding its own experts' bytes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from engine_helpers import greedy
from lazy_engines import lazy_engines
from tiny_checkpoints import hf_greedy
from v4_release_checkpoints import write_v4_release
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.errors import CheckpointError, UnsupportedArchitectureError
from moe_runtime.models.deepseek_v4 import checkpoint_name
from moe_runtime.models.deepseek_v4_support import refuse_unsupported
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.deepseek_fp4_format import PackedFp4, block_scales_as_float
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat

NEW_TOKENS = 8
PROMPTS = [   # past the 8-token window, several CSA entries of 4 and HCA entries of 16 (tests/test_deepseek_v4.py)
    [(7 * i + 3) % 500 + 5 for i in range(45)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
]
LAYOUTS = {
    "one_rank": {},
    "one_rank_mxfp4": dict(quantization="mxfp4"),
    "ep2_dp2_mxfp4": dict(quantization="mxfp4", ep=2, dp_attn=2),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """(twin, release) from the tiny V4 checkpoint."""
    return write_v4_release(tiny_checkpoint_factory("deepseek_v4"), tmp_path_factory.mktemp("v4_release"))


@pytest.fixture(scope="module")
def engines(checkpoints):
    with lazy_engines(checkpoints[1], LAYOUTS, device="cpu", dtype="float32") as get:
        yield get


@pytest.fixture(scope="module")
def expected(checkpoints):
    tokens = hf_greedy(checkpoints[0], PROMPTS, NEW_TOKENS)
    assert max(len(set(continuation)) for continuation in tokens) > 2, "degenerate oracle tokens"
    return tokens


def test_the_release_reads_back_as_its_twin(checkpoints):
    """Its dtypes are the release's; transformers' dequantizer and the reader both give the twin, exactly."""
    twin_dir, release_dir = checkpoints
    twin, release = load_file(str(twin_dir / "model.safetensors")), load_file(str(release_dir / "model.safetensors"))
    expert, linear = "layers.1.ffn.experts.5.w2", "layers.0.attn.wo_a"
    assert release[expert + ".weight"].dtype == torch.int8 and release[expert + ".scale"].dtype == torch.float8_e8m0fnu
    assert release[expert + ".weight"].shape == (128, 32) and release[expert + ".scale"].shape == (128, 2)
    assert release[linear + ".weight"].dtype == torch.float8_e4m3fn and release[linear + ".scale"].shape == (3, 4)
    assert release["layers.0.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    assert "layers.0.attn.compressor.wkv.scale" not in release and "embed.weight" in release
    theirs = Fp8Dequantize(None)
    for name in (expert, linear, "layers.2.ffn.shared_experts.w1"):
        assert torch.equal(theirs._dequantize_one(release[name + ".weight"], release[name + ".scale"], torch.float32),
                           twin["model." + name + ".weight"]), name
    config = load_hf_config(release_dir)
    reader = CheckpointReader.open(release_dir, Fp8BlockFormat.from_hf_config(config, str(release_dir)), config)
    reader.renamed(checkpoint_name)
    for name, tensor in twin.items():
        assert torch.equal(reader.read(checkpoint_name(name)).to(tensor.dtype), tensor), name
    assert reader.is_fp4(checkpoint_name("model." + expert + ".weight"))
    assert reader.shape(checkpoint_name("model." + expert + ".weight")) == (128, 64)
    assert set(reader.consumed) == set(reader.names())   # every scale read with its weight


def test_one_rank_tokens_equal_transformers_on_the_twin(engines, expected):
    assert [o.token_ids for o in engines("one_rank").generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def assert_slot_holds_the_release(experts, slot: int, expert: int, release: dict) -> None:
    stored = {w: (release[f"layers.1.ffn.experts.{expert}.{w}.weight"].view(torch.uint8),
                  release[f"layers.1.ffn.experts.{expert}.{w}.scale"].view(torch.uint8)) for w in ("w1", "w2", "w3")}
    assert torch.equal(experts.w13[slot], torch.cat([stored["w1"][0], stored["w3"][0]]))
    assert torch.equal(experts.w13_scale[slot], torch.cat([stored["w1"][1], stored["w3"][1]]))
    assert torch.equal(experts.w2[slot], stored["w2"][0]) and torch.equal(experts.w2_scale[slot], stored["w2"][1])


def test_mxfp4_keeps_the_released_fp4_bytes(engines, checkpoints):
    """Each expert slot holds w1 then w3 (w13) and w2 as the release stores them, e8m0 scales as bytes (their
    tokens: the EP test below); the shared experts stay in the compute dtype. A slot reloaded from the checkpoint
    (a lost rank's expert) reads it under the same DeepSeek names."""
    model = engines("one_rank_mxfp4").core.model
    release = load_file(str(checkpoints[1] / "model.safetensors"))
    ffn = model.model.layers[1].ffn
    experts = ffn.experts
    assert experts.w13.dtype == torch.uint8 and ffn.shared_experts.w13.dtype == torch.float32
    for slot, expert in enumerate(experts.expert_ids):
        assert_slot_holds_the_release(experts, slot, expert, release)
    experts.reload_slot(0, 5)
    assert experts.expert_ids[0] == 5
    assert_slot_holds_the_release(experts, 0, 5, release)


@pytest.mark.slow
def test_expert_parallel_with_dp_attention_keeps_fp4_experts(engines, expected):
    """Each EP rank keeps its own experts' FP4 bytes; each DP worker its sequences' compressed state."""
    assert [o.token_ids for o in engines("ep2_dp2_mxfp4").generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def test_fp4_scales_read_alike_as_e8m0_uint8_or_float32_powers_of_two():
    """transformers writes e8m0 scales as float8_e8m0fnu, MXFP8-style checkpoints as uint8 bytes, a `float` scale_fmt
    as float32: the same powers of two decode alike; a float32 scale that is none is refused by name."""
    values = torch.randint(-128, 128, (4, 32), dtype=torch.int8)                     # [N, K/2]: K = 64
    exponents = torch.randint(120, 135, (4, 2), dtype=torch.uint8)                    # [N, K/32]
    stored = [exponents.view(torch.float8_e8m0fnu), exponents, block_scales_as_float(exponents)]
    decoded = [PackedFp4.from_stored(values, scale, "w").dequantized() for scale in stored]
    assert all(torch.equal(d, decoded[0]) for d in decoded) and decoded[0].abs().max() > 0
    assert torch.equal(block_scales_as_float(exponents), exponents.view(torch.float8_e8m0fnu).float())
    with pytest.raises(CheckpointError, match=r"w: FP4 scales of dtype torch.float32 that are not all powers of two"):
        PackedFp4.from_stored(values, stored[2] * 1.5, "w")


def test_an_unknown_expert_dtype_is_refused_by_name():
    cfg = SimpleNamespace(quantization_config={"quant_method": "fp8", "expert_dtype": "nvfp4"})
    with pytest.raises(UnsupportedArchitectureError, match=r"expert_dtype='nvfp4': not implemented"):
        refuse_unsupported(cfg, SimpleNamespace(quant=None, engine=None))
