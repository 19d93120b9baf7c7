"""FP8 block-quantized checkpoints (DeepSeek-V3/R1, Qwen3-FP8 layout) load right or not at all.

Oracle: transformers on the same weights dequantized offline. A tensor the model does not read,
or a quantization_config it does not implement, is an error naming it: such a checkpoint once
loaded without a word and generated wrong tokens.
"""
import json
import logging
import shutil

import pytest
from safetensors.torch import load_file, save_file

import torch
from engine_helpers import PROMPTS, greedy
from fp8_checkpoints import write_fp8_checkpoint
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.errors import CheckpointError
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat

NEW_TOKENS = 8
# FP8 keeps every weight (or activation) within 2**-4 relative of its block's scale: the tiny random
# model's prompt log-probabilities then move by 0.055 on average and 0.22 at most (weights quantized at
# load), 0.015 / 0.037 (activations on the dispatch wire): far from the 0 of an FP8 path not taken, and
# from the several nats of a wrong scale or a misrouted row
FP8_LOGPROB_MAX_ERROR, FP8_LOGPROB_MEAN_ERROR = 0.5, 0.1


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """arch -> (FP8 checkpoint, dequantized oracle, the oracle's greedy tokens), each built once."""
    root = tmp_path_factory.mktemp("fp8")
    built = {}

    def get(arch: str, block: tuple[int, int]):
        if arch not in built:
            fp8, oracle = write_fp8_checkpoint(tiny_checkpoint_factory(arch), root / f"{arch}-fp8",
                                               root / f"{arch}-oracle", block, with_mtp=arch.startswith("deepseek"))
            built[arch] = (fp8, oracle, hf_greedy(oracle, PROMPTS, NEW_TOKENS))
        return built[arch]
    return get


def _generate(path, **layout) -> list[list[int]]:
    with LLM(str(path), device="cpu", dtype="float32", **layout) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]


def test_block_quantization_round_trip_keeps_partial_edge_blocks():
    fmt = Fp8BlockFormat(32, 48)
    weight = torch.randn(70, 100)                       # partial blocks on both edges
    values, scale_inv = fmt.quantize(weight)
    assert values.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == (3, 3)
    restored = fmt.dequantize(values, scale_inv)
    # e4m3 keeps 3 mantissa bits (6.25% relative) down to 2**-6 of the block's scale, then subnormals
    assert ((restored - weight).abs() <= 0.0625 * weight.abs() + scale_inv.max() * 2**-9).all()
    with pytest.raises(CheckpointError, match="needs w_scale_inv of shape"):   # scales for other blocks
        Fp8BlockFormat(64, 64).dequantize(values, scale_inv, "w")


def test_deepseek_v3_fp8_with_mtp_layer_matches_transformers_on_two_ep_ranks(fp8_checkpoints, caplog):
    fp8, _, expected = fp8_checkpoints("deepseek_v3", (32, 48))
    assert _generate(fp8, ep=2) == expected


def test_qwen3_moe_fp8_matches_transformers(fp8_checkpoints, caplog):
    fp8, _, expected = fp8_checkpoints("qwen3_moe", (128, 128))
    with caplog.at_level(logging.INFO, logger="moe_runtime.weights.loading"):
        assert _generate(fp8) == expected


def test_mtp_layer_is_skipped_with_a_log_line(fp8_checkpoints, caplog):
    fp8, _, _ = fp8_checkpoints("deepseek_v3", (32, 48))
    with caplog.at_level(logging.INFO, logger="moe_runtime.weights.loading"):
        LLM(str(fp8), device="cpu", dtype="float32").shutdown()
    assert "multi-token-prediction layer(s) 3..3" in caplog.text


def test_a_tensor_the_model_does_not_read_is_named(fp8_checkpoints, tmp_path):
    fp8, _, _ = fp8_checkpoints("qwen3_moe", (128, 128))
    path = shutil.copytree(fp8, tmp_path / "extra")
    shard = path / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.mystery_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(shard))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.mystery_proj.weight"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.mystery_proj\.weight"):
        LLM(str(path), device="cpu")


def test_fp8_weights_without_quantization_config_are_refused(fp8_checkpoints, tmp_path):
    fp8, _, _ = fp8_checkpoints("qwen3_moe", (128, 128))
    path = shutil.copytree(fp8, tmp_path / "no-config")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn but config\.json has no quantization_config"):
        LLM(str(path), device="cpu")


@pytest.mark.parametrize("change, named", [
    ({"quant_method": "hqq"}, "quant_method='hqq'"),   # awq, gptq: int4 formats (test_int4_checkpoints.py)
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ({"weight_block_size": None}, "weight_block_size=None"),
])
def test_an_unsupported_quantization_config_is_named(fp8_checkpoints, tmp_path, change, named):
    fp8, _, _ = fp8_checkpoints("qwen3_moe", (128, 128))
    path = shutil.copytree(fp8, tmp_path / "bad-quant")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=named):
        LLM(str(path), device="cpu")


# ---- --quantization fp8: weights stay FP8 in memory, dequantized per matmul tile ---------------------------

def _prompt_logprobs(llm) -> list[float]:
    """The logprob of every prompt token after the first, over PROMPTS (a view of the logits)."""
    values = []
    for output in llm.generate(PROMPTS, greedy(1, prompt_logprobs=0)):
        values += [entry.logprob for entry in output.prompt_logprobs[1:]]
    return values


def _param_bytes(model) -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


def test_qwen3_moe_kept_in_fp8_gives_the_dequantized_logits_in_under_30_percent_of_the_bytes(fp8_checkpoints):
    fp8, _, expected = fp8_checkpoints("qwen3_moe", (128, 128))
    with LLM(str(fp8), device="cpu", dtype="float32") as dequantized:
        reference = _prompt_logprobs(dequantized)
        fp32_bytes = _param_bytes(dequantized.core.model)
    with LLM(str(fp8), device="cpu", dtype="float32", quantization="fp8") as kept:
        assert [o.token_ids for o in kept.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        # the same dequantized products in fp32; only the summation order of the tiles differs
        assert torch.allclose(torch.tensor(_prompt_logprobs(kept)), torch.tensor(reference), atol=1e-4, rtol=0)
        model = kept.core.model
        layer = model.model.layers[0]
        assert layer.mlp.experts.w13.dtype == layer.mlp.experts.w2.dtype == torch.float8_e4m3fn
        assert layer.self_attn.q_proj.weight.dtype == layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
        assert model.model.embed_tokens.weight.dtype == layer.mlp.gate.weight.dtype == torch.float32  # not quantized
        in_fp8 = [name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        scales = [name for name in _param_bytes(model) if name.endswith("_scale")]
        kept_bytes = _param_bytes(model)
    assert set(kept_bytes) - set(scales) == set(fp32_bytes)
    assert sum(kept_bytes[n] for n in in_fp8 + scales) < 0.3 * sum(fp32_bytes[n] for n in in_fp8)
    assert all(kept_bytes[n] == fp32_bytes[n] for n in fp32_bytes if n not in in_fp8)


def test_deepseek_v3_kept_in_fp8_on_two_ep_ranks_survives_moving_experts(fp8_checkpoints):
    """Redundant experts and live migration move FP8 weights with their scales: tokens stay the oracle's."""
    fp8, _, expected = fp8_checkpoints("deepseek_v3", (32, 48))
    with LLM(str(fp8), device="cpu", dtype="float32", quantization="fp8", ep=2, num_redundant_experts=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        moved = llm.rebalance_now()
        assert moved.ok and moved.experts_moved > 0, moved
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected


def test_llama_kept_in_fp8_under_tensor_parallelism_matches_transformers(fp8_checkpoints):
    """tp=2 cuts q/k/v and gate/up by rows (any row) and o_proj/down_proj by 64-column blocks."""
    fp8, _, expected = fp8_checkpoints("llama", (16, 64))
    with LLM(str(fp8), device="cpu", dtype="float32", quantization="fp8", tp=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected


@pytest.fixture(scope="module")
def qwen3_moe_logprobs(tiny_checkpoint_factory):
    """(fp32 checkpoint, its prompt logprobs on one rank without any FP8)."""
    checkpoint = tiny_checkpoint_factory("qwen3_moe")
    with LLM(str(checkpoint), device="cpu", dtype="float32") as full:
        return checkpoint, torch.tensor(_prompt_logprobs(full))


def test_an_unquantized_checkpoint_is_quantized_at_load(qwen3_moe_logprobs):
    checkpoint, reference = qwen3_moe_logprobs
    with LLM(str(checkpoint), device="cpu", dtype="float32", quantization="fp8") as quantized:
        assert quantized.core.model.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
        error = (torch.tensor(_prompt_logprobs(quantized)) - reference).abs()
    assert 0 < error.max() < FP8_LOGPROB_MAX_ERROR and error.mean() < FP8_LOGPROB_MEAN_ERROR, error


def test_fp8_dispatch_on_two_ep_ranks_stays_within_fp8_error(qwen3_moe_logprobs):
    """--dispatch-fp8: tokens cross the EP wire as FP8 with per-128-column scales; combine stays fp32."""
    checkpoint, reference = qwen3_moe_logprobs
    with LLM(str(checkpoint), device="cpu", dtype="float32", ep=2, dp_attn=2, dispatch_fp8=True) as llm:
        error = (torch.tensor(_prompt_logprobs(llm)) - reference).abs()
    assert 0 < error.max() < FP8_LOGPROB_MAX_ERROR and error.mean() < FP8_LOGPROB_MEAN_ERROR, error


def test_an_unknown_quantization_is_refused_by_its_flag():
    with pytest.raises(ValueError, match="--quantization int3 is not supported"):
        LLM("unused", device="cpu", quantization="int3")
    with pytest.raises(ValueError, match="--dispatch-fp8 needs --ep > 1"):
        LLM("unused", device="cpu", dispatch_fp8=True)


def test_minimax_m2s_fmt_spelling_loads(fp8_checkpoints, tmp_path):
    """MiniMax-M2 / M2.5 publish `"fmt": "float8_e4m3fn"` (the torch dtype's name) for DeepSeek's `e4m3`."""
    fp8, _, expected = fp8_checkpoints("qwen3_moe", (128, 128))
    path = shutil.copytree(fp8, tmp_path / "minimax-fmt")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["fmt"] = "float8_e4m3fn"
    (path / "config.json").write_text(json.dumps(config))
    assert _generate(path) == expected
