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
from moe_runtime.quantization.fp8_block import Fp8BlockFormat

NEW_TOKENS = 8


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
    with caplog.at_level(logging.INFO, logger="moe_runtime.weight_loading"):
        assert _generate(fp8) == expected


def test_mtp_layer_is_skipped_with_a_log_line(fp8_checkpoints, caplog):
    fp8, _, _ = fp8_checkpoints("deepseek_v3", (32, 48))
    with caplog.at_level(logging.INFO, logger="moe_runtime.weight_loading"):
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
    ({"quant_method": "awq"}, "quant_method='awq'"),
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
