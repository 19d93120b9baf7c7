"""Tiny FP8 block-quantized checkpoints in exactly DeepSeek-V3's published layout, and their oracle.

From a tiny fp32 checkpoint: every decoder-layer linear weight is quantized blockwise to
float8_e4m3fn with its `weight_scale_inv`, the config gains `quantization_config`, an MTP layer
(`num_nextn_predict_layers`) is appended, and the tensors are written as two shards with an
index. The oracle checkpoint holds the dequantized weights in fp32 with no quantization config,
so transformers on it computes exactly what a correct FP8 loader must.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_runtime.quantization.fp8_block import SCALE_SUFFIX, Fp8BlockFormat

INDEX_FILE = "model.safetensors.index.json"


def is_quantized_in_fp8_layout(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3 quantizes the decoder layers' linear weights; embeddings, lm_head, norms and the router stay."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith("mlp.gate.weight"))


def _read_all(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _copy_side_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != INDEX_FILE:
            shutil.copyfile(file, target / file.name)


def _write_two_shards(tensors: dict[str, torch.Tensor], target: Path) -> None:
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file_name, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(target / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    (target / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _mtp_layer(tensors: dict[str, torch.Tensor], num_layers: int, hidden: int) -> dict[str, torch.Tensor]:
    """Layer `num_layers` as DeepSeek-V3 stores its MTP module: a decoder layer plus enorm/hnorm/eh_proj/head."""
    last = f"model.layers.{num_layers - 1}."
    mtp = {f"model.layers.{num_layers}." + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    mtp[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(hidden)
    mtp[f"model.layers.{num_layers}.hnorm.weight"] = torch.ones(hidden)
    mtp[f"model.layers.{num_layers}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    mtp[f"model.layers.{num_layers}.shared_head.norm.weight"] = torch.ones(hidden)
    return mtp


def write_fp8_checkpoint(source: Path, fp8_dir: Path, oracle_dir: Path, block: tuple[int, int],
                         with_mtp: bool = True) -> tuple[Path, Path]:
    """(FP8 checkpoint, dequantized oracle checkpoint) from the fp32 checkpoint `source`."""
    fmt = Fp8BlockFormat(*block)
    config = json.loads((source / "config.json").read_text())
    tensors = _read_all(source)
    if with_mtp:
        tensors.update(_mtp_layer(tensors, config["num_hidden_layers"], config["hidden_size"]))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if is_quantized_in_fp8_layout(name, tensor):
            values, scale_inv = fmt.quantize(tensor)
            quantized[name], quantized[name + SCALE_SUFFIX] = values, scale_inv
            dequantized[name] = fmt.dequantize(values, scale_inv)
        else:
            quantized[name] = dequantized[name] = tensor
    _copy_side_files(source, fp8_dir)
    _write_two_shards(quantized, fp8_dir)
    fp8_config = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                   "weight_block_size": list(block)})
    if with_mtp:
        fp8_config["num_nextn_predict_layers"] = 1
    (fp8_dir / "config.json").write_text(json.dumps(fp8_config, indent=2))
    _copy_side_files(source, oracle_dir)
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    _write_two_shards({n: t for n, t in dequantized.items() if not n.startswith(mtp_prefix)}, oracle_dir)
    return fp8_dir, oracle_dir
