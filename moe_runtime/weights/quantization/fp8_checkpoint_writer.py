"""Write a checkpoint in DeepSeek-V3's FP8 block layout from an unquantized one.

The decoder layers' linear weights become float8_e4m3fn with `weight_scale_inv` block scales;
embeddings, the LM head, norms and routers stay as they are (the published format's choice), and
config.json gains `quantization_config`. Used by the tests (FP8 checkpoints to load) and the
offline bench (FP8 rows); `dequantized` is the oracle: the same weights as the FP8 ones, in float32.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_runtime.weights.quantization.fp8_block import SCALE_SUFFIX, Fp8BlockFormat

INDEX_FILE = "model.safetensors.index.json"


def is_quantized_in_fp8_layout(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3 quantizes the decoder layers' linear weights; embeddings, lm_head, norms and the router stay (as
    MiniMax-M2's `block_sparse_moe.gate` does)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))


@dataclass
class Fp8Tensors:
    quantized: dict[str, torch.Tensor] = field(default_factory=dict)     # as the FP8 checkpoint stores them
    dequantized: dict[str, torch.Tensor] = field(default_factory=dict)   # what they mean, float32 where quantized


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: Fp8BlockFormat) -> Fp8Tensors:
    out = Fp8Tensors()
    for name, tensor in tensors.items():
        if is_quantized_in_fp8_layout(name, tensor):
            values, scale_inv = fmt.quantize(tensor)
            out.quantized[name], out.quantized[name + SCALE_SUFFIX] = values, scale_inv
            out.dequantized[name] = fmt.dequantize(values, scale_inv)
        else:
            out.quantized[name] = out.dequantized[name] = tensor
    return out


def read_all_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def copy_side_files(source: Path, target: Path) -> None:
    """config, tokenizer and generation files: everything but the weights."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != INDEX_FILE:
            shutil.copyfile(file, target / file.name)


def write_two_shards(tensors: dict[str, torch.Tensor], target: Path) -> None:
    """Two safetensors shards and their index, as sharded hub checkpoints come."""
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file_name, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(target / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    (target / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fp8_config(config: dict, fmt: Fp8BlockFormat) -> dict:
    return dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [fmt.block_rows, fmt.block_cols]})


def write_fp8_checkpoint(source: Path, target: Path, fmt: Fp8BlockFormat = Fp8BlockFormat()) -> Fp8Tensors:
    """`source` quantized into `target`; returns the tensors (dequantized: the oracle's weights)."""
    tensors = quantize_tensors(read_all_tensors(source), fmt)
    copy_side_files(source, target)
    write_two_shards(tensors.quantized, target)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(fp8_config(config, fmt), indent=2))
    return tensors
