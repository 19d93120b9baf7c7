"""MXFP4 checkpoints as gpt-oss publishes them (`*_blocks` / `*_scales`, quant_method mxfp4), at the weights
level: the writer's layout is transformers' (its own dequantizer reads it back to the twin), the reader
dequantizes exactly, `--quantization mxfp4` keeps the stored bytes and its expert kernels equal the
dequantized ones within fp32 rounding, and migration moves an MXFP4 expert (codes, scales, biases) exactly."""
from pathlib import Path

import pytest
import torch
from expert_epilogue_reference import activations
from safetensors import safe_open
from mxfp4_checkpoints import write_mxfp4_checkpoint
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS, LAYOUT_MASKED
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4, quantize_mxfp4
from moe_runtime.config.engine_config import QUANTIZATIONS
from moe_runtime.front.llm import LLM
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.expert_weights import GPT_OSS_NAMING, ExpertWeights
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.in_memory import weights_in_memory
from moe_runtime.weights.quantization.mxfp4_format import declares_mxfp4
from moe_runtime.weights.quantization.mxfp4_in_memory import Mxfp4InMemory
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.weights.quantization.weight_quantization import linear_quantization

E, H, I, LAYERS = 4, 64, 32, 2
EXPERTS = "model.layers.{}.mlp.experts."
GPT_OSS = ExpertActivation.gpt_oss()
TORCH = get_kernels("cpu", "torch")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(twin, mxfp4) written from a tiny random gpt-oss."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                          num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          vocab_size=64, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    model.save_pretrained(root / "source")
    return write_mxfp4_checkpoint(root / "source", root)


def stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def loaded_experts(path: Path, layer: int, quant=None, expert_ids=None) -> ExpertWeights:
    experts = ExpertWeights(list(range(E)) if expert_ids is None else expert_ids, H, I, GPT_OSS_NAMING, quant=quant,
                            bias=True, activation=GPT_OSS)
    experts.load_weights(CheckpointReader.open(path), EXPERTS.format(layer))
    return experts


def test_published_layout_and_transformers_reads_it_as_the_twin(checkpoints):
    twin, mxfp4 = map(stored, checkpoints)
    prefix = EXPERTS.format(0)
    assert twin[prefix + "gate_up_proj"].shape == (E, H, 2 * I) and prefix + "gate_up_proj" not in mxfp4
    assert mxfp4[prefix + "gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16)
    assert mxfp4[prefix + "gate_up_proj_scales"].shape == (E, 2 * I, H // 32)
    assert mxfp4[prefix + "down_proj_blocks"].shape == (E, H, I // 32, 16)
    assert mxfp4[prefix + "gate_up_proj_blocks"].dtype == torch.uint8
    for name in ("gate_up_proj", "down_proj"):
        theirs = convert_moe_packed_tensors(mxfp4[prefix + name + "_blocks"], mxfp4[prefix + name + "_scales"],
                                            dtype=torch.float32)
        assert torch.equal(theirs, twin[prefix + name]), name
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        assert torch.equal(mxfp4[prefix + name], twin[prefix + name])
    assert not any(name.endswith("_blocks") for name in mxfp4 if ".experts." not in name)
    assert (mxfp4[prefix + "gate_up_proj_scales"] != mxfp4[prefix + "gate_up_proj_scales"].flatten()[0]).any()


def test_reader_dequantizes_exactly_and_records_both_tensors(checkpoints):
    twin_path, mxfp4_path = checkpoints
    reader = CheckpointReader.open(mxfp4_path)
    name = EXPERTS.format(1) + "down_proj"
    assert reader.is_mxfp4(name) and not reader.is_mxfp4(EXPERTS.format(1) + "down_proj_bias")
    assert reader.shape(name) == (E, I, H)
    assert torch.equal(reader.read(name), stored(twin_path)[name])
    assert torch.equal(reader.read_rows(name, 1, 3), stored(twin_path)[name][1:3])
    assert {name + "_blocks", name + "_scales"} <= reader.consumed


@pytest.mark.parametrize("layer", range(LAYERS))
def test_experts_load_from_mxfp4_as_from_the_twin(checkpoints, layer):
    twin, mxfp4 = checkpoints
    from_twin, from_mxfp4 = loaded_experts(twin, layer), loaded_experts(mxfp4, layer)
    for ours, theirs in zip(from_mxfp4.slot_tensors(), from_twin.slot_tensors()):
        assert torch.equal(ours, theirs)


def test_mxfp4_in_memory_keeps_the_stored_bytes(checkpoints):
    twin, mxfp4 = checkpoints
    quant = Mxfp4InMemory(TORCH)
    kept = loaded_experts(mxfp4, 0, quant)
    assert kept.w13.dtype == torch.uint8 and kept.w13.shape == (E, 2 * I, H // 2)
    assert kept.w13_scale.dtype == torch.uint8 and kept.w13_scale.shape == (E, 2 * I, H // 32)
    stored_blocks = stored(mxfp4)[EXPERTS.format(0) + "gate_up_proj_blocks"].flatten(-2)   # [E, 2I, H/2], interleaved
    assert torch.equal(kept.w13[:, :I], stored_blocks[:, 0::2]) and torch.equal(kept.w13[:, I:], stored_blocks[:, 1::2])
    plain = loaded_experts(twin, 0)
    assert torch.equal(dequantize_mxfp4(kept.w13, kept.w13_scale, H), plain.w13)
    assert torch.equal(dequantize_mxfp4(kept.w2, kept.w2_scale, I), plain.w2)
    from_twin = loaded_experts(twin, 0, quant)          # a plain checkpoint quantized at load: the same values
    assert torch.equal(dequantize_mxfp4(from_twin.w13, from_twin.w13_scale, H), plain.w13)


@pytest.mark.parametrize("family", ["torch", "reference"])
@pytest.mark.parametrize("layout", [LAYOUT_CONTIGUOUS, LAYOUT_MASKED])
def test_mxfp4_expert_kernel_equals_the_dequantized_one(checkpoints, family, layout):
    twin, mxfp4 = checkpoints
    kernels = get_kernels("cpu", family)
    kept, plain = loaded_experts(mxfp4, 1, Mxfp4InMemory(kernels)), loaded_experts(twin, 1)
    kernel = expert_kernel_for(layout, kernels)
    counts = torch.tensor([3, 0, 7, 2])
    if layout == LAYOUT_CONTIGUOUS:
        x = activations(12, H)
    else:
        x = activations(E * 7, H).view(E, 7, H)
    got, want = kernel(x, counts, kept), kernel(x, counts, plain)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_mxfp4_quantize_round_trips_representable_weights():
    weight = torch.randn(6, 16, 96) * 5
    values, scales = quantize_mxfp4(weight)
    rounded = dequantize_mxfp4(values, scales, 96)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(rounded), 96), rounded)
    assert float((rounded - weight).abs().max()) <= float(weight.abs().max()) / 4   # e2m1: 1-2 significant bits


def test_migration_moves_an_mxfp4_expert_exactly(checkpoints):
    _, mxfp4 = checkpoints
    quant = Mxfp4InMemory(TORCH)
    source = loaded_experts(mxfp4, 0, quant, expert_ids=[0, 1])
    target = loaded_experts(mxfp4, 1, quant, expert_ids=[2, 3])
    assert source.slot_bytes == (2 * I * (H // 2 + H // 32) + H * (I // 2 + I // 32)) + 4 * (2 * I + H)
    target.stage(0, 1, source.read_slot(1))
    target.commit()
    assert target.expert_ids == [1, 3]
    for ours, theirs in zip(target.slot_tensors(), source.slot_tensors()):
        assert torch.equal(ours[0], theirs[1])


def test_mxfp4_is_a_quantization_and_a_recognized_checkpoint():
    assert "mxfp4" in QUANTIZATIONS
    quant = weights_in_memory("mxfp4", None, TORCH)
    assert isinstance(quant, Mxfp4InMemory) and linear_quantization(quant) is None
    assert linear_quantization(weights_in_memory("int8", None, TORCH)) is not None
    config = GptOssConfig(quantization_config={"quant_method": "mxfp4"})
    assert declares_mxfp4(config) and Fp8BlockFormat.from_hf_config(config, "here") is None
    assert not declares_mxfp4(GptOssConfig())


def test_mxfp4_linear_equals_the_dequantized_weight():
    weight, bias = torch.randn(24, 80), torch.randn(24)
    values, scales = quantize_mxfp4(weight)
    x = activations(3, 80)
    want = torch.nn.functional.linear(x, dequantize_mxfp4(values, scales, 80), bias)
    torch.testing.assert_close(Mxfp4InMemory(TORCH).linear(x, values, scales, bias), want, rtol=1e-5, atol=1e-5)


def test_under_mxfp4_only_the_routed_experts_are_kept_in_mxfp4(tiny_checkpoint_factory):
    """MXFP4 is an experts-only format: attention projections, dense MLPs and shared experts of any model stay in
    the compute dtype (as gpt-oss publishes them), the routed experts are kept packed."""
    path = tiny_checkpoint_factory("deepseek_v3")         # dense first layer, shared and routed experts
    with LLM(str(path), device="cpu", dtype="float32", quantization="mxfp4") as llm:
        model = llm.core.model
        layers = model.model.layers
        assert all(getattr(module, "quant", None) is None for layer in layers
                   for module in layer.self_attn.modules() if module is not layer.self_attn)
        assert layers[0].mlp.quant is None                                     # the dense first layer
        assert layers[1].mlp.shared_experts.quant is None
        assert layers[1].mlp.experts.quant is not None and layers[1].mlp.experts.w13.dtype == torch.uint8
        assert len(llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3
