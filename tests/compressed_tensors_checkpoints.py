"""Tiny checkpoints in compressed-tensors' layout, written by the library itself, with their dequantized twins.

Every projection of the decoder (attention, dense MLP, each routed expert) is compressed with one of the
library's preset schemes: scales from the weights' min/max through `calculate_qparams`, then the scheme's own
compressor (`compress`): packed int4 with group scales and zero points, int8 channel, FP8 per tensor, channel
or block, exactly as llm-compressor writes them. The twin holds what the same compressor's `decompress` gives
back, in full precision: transformers' tokens on the twin are the oracle for the runtime on the compressed one.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils.match import match_name

from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors, write_two_shards

GROUP_SIZE = 32          # divides every tiny projection's input width
BLOCK = [32, 32]


def scheme_of(preset: str):
    scheme = preset_name_to_scheme(preset, ["Linear"])
    weights = scheme.weights
    if weights.strategy == QuantizationStrategy.GROUP:
        scheme.weights = weights.model_copy(update={"group_size": GROUP_SIZE})
    if weights.strategy == QuantizationStrategy.BLOCK:
        scheme.weights = weights.model_copy(update={"block_structure": BLOCK})
    scheme.format = CompressionFormat(infer_module_format(torch.nn.Linear, scheme))
    return scheme


def extremes(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of `weight` [N, K] over each of the strategy's scale's elements."""
    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.view(rows, cols // args.group_size, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)                                        # [N, K/g]
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)                 # [N, 1]
    if args.strategy == QuantizationStrategy.BLOCK:
        bn, bk = args.block_structure
        padded = F.pad(weight, (0, -cols % bk, 0, -rows % bn))
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        return blocks.amin((1, 3)), blocks.amax((1, 3))                                   # [N/bn, K/bk]
    return weight.amin().reshape(1), weight.amax().reshape(1)                             # tensor


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear layers: what llm-compressor targets with ["Linear"] and ignore=["lm_head"] (the
    router's gate stays full precision too, as recipes ignore it)."""
    return (name.endswith(".weight") and tensor.dim() == 2 and ".layers." in name and "norm" not in name
            and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))


def write_compressed_checkpoint(source: Path, target: Path, twin: Path, preset: str,
                                ignore: tuple[str, ...] = ("lm_head",)) -> tuple[Path, Path]:
    """`ignore`: the config's ignore list (module names, or "re:" patterns as the library matches them); those
    projections stay full precision, e.g. Kimi K2 Thinking's attention, shared experts and dense MLP."""
    config = json.loads((source / "config.json").read_text())
    tensors = read_all_tensors(source)
    scheme = scheme_of(preset)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    compressed, dense = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not is_projection(name, tensor) or any(match_name(module, pattern) for pattern in ignore):
            compressed[name] = dense[name] = tensor
            continue
        weight = tensor.float()
        scale, zero_point = calculate_qparams(*extremes(weight, scheme.weights), scheme.weights)
        state = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                                    scheme)
        compressed.update({f"{module}.{key}": value for key, value in state.items()})
        dense[name] = compressor.decompress(dict(state), scheme)["weight"].to(tensor.dtype)
    quantization = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                      format=scheme.format.value, quantization_status="compressed")
    for path, written in ((target, compressed), (twin, dense)):
        copy_side_files(source, path)
        write_two_shards(written, path)
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = quantization.model_dump(mode="json", exclude_none=True)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target, twin
