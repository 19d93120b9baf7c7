"""Write a gpt-oss checkpoint in the published MXFP4 layout, with its dequantized twin.

gpt-oss's published checkpoints quantize the experts' `gate_up_proj` and `down_proj` stacks only
(mxfp4_format.py: `<name>_blocks` [E, N, G, 16] and `<name>_scales` [E, N, G], output-major) and
keep everything else in bf16, with `quantization_config: {quant_method: mxfp4, modules_to_not_convert:
[...]}`. Tests need such a checkpoint AND its exact meaning: `write_mxfp4_twins` rounds the source's
expert stacks to MXFP4 values once, writes that rounding as a plain (dequantized) checkpoint, the
"twin", and writes the same values as blocks and scales. Every twin value is an e2m1 code times its
block's power of two, so dequantizing the MXFP4 checkpoint gives the twin exactly (in float32; a bf16
twin holds them exactly too, since e2m1 needs 2 significant bits).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4, quantize_mxfp4
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors
from moe_runtime.weights.quantization.mxfp4_format import BLOCKS_SUFFIX, QUANT_METHOD, SCALES_SUFFIX

QUANTIZED_STACK = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")   # transformers' Mxfp4HfQuantizer's choice
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass
class Mxfp4Tensors:
    packed: dict[str, torch.Tensor] = field(default_factory=dict)    # as the MXFP4 checkpoint stores them
    twin: dict[str, torch.Tensor] = field(default_factory=dict)      # their meaning, in the source's dtypes


def mxfp4_stack(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stack in transformers' parameter layout [E, K, N] -> (blocks [E, N, G, 16], scales [E, N, G],
    its MXFP4 rounding [E, K, N] float32)."""
    values, scales = quantize_mxfp4(stack.float().transpose(1, 2))          # [E, N, G*16], [E, N, G]
    rounded = dequantize_mxfp4(values, scales, stack.shape[1]).transpose(1, 2)
    return values.unflatten(-1, (scales.shape[-1], 16)).contiguous(), scales, rounded.contiguous()


def quantize_expert_stacks(tensors: dict[str, torch.Tensor]) -> Mxfp4Tensors:
    out = Mxfp4Tensors()
    for name, tensor in tensors.items():
        if QUANTIZED_STACK.search(name) and tensor.dim() == 3:
            if tensor.shape[1] % 32:
                raise ValueError(f"{name}: MXFP4 stacks need input dims in whole 32-value blocks, got {tuple(tensor.shape)}")
            blocks, scales, rounded = mxfp4_stack(tensor)
            out.packed[name + BLOCKS_SUFFIX], out.packed[name + SCALES_SUFFIX] = blocks, scales
            out.twin[name] = rounded.to(tensor.dtype)
        else:
            out.packed[name] = out.twin[name] = tensor
    return out


def mxfp4_config(config: dict) -> dict:
    return dict(config, quantization_config={"quant_method": QUANT_METHOD, "modules_to_not_convert": NOT_CONVERTED})


def write_mxfp4_twins(source: Path, twin: Path, mxfp4: Path) -> Mxfp4Tensors:
    """`source` (a dequantized gpt-oss checkpoint) -> `twin` (its experts rounded to MXFP4 values, plain) and
    `mxfp4` (the same values in the published layout). Returns the tensors written."""
    source, twin, mxfp4 = Path(source), Path(twin), Path(mxfp4)
    tensors = quantize_expert_stacks(read_all_tensors(source))
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    for target, weights, target_config in ((twin, tensors.twin, config), (mxfp4, tensors.packed, mxfp4_config(config))):
        copy_side_files(source, target)
        save_file({n: t.contiguous() for n, t in weights.items()}, str(target / "model.safetensors"),
                  metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps(target_config, indent=2))
    return tensors
