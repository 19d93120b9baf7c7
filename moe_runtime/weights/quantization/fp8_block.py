"""FP8 block quantization as DeepSeek-V3/R1 and Qwen3-FP8 checkpoints store it.

A quantized linear weight `W` [N, K] is stored as `weight` (float8_e4m3fn, [N, K]) and
`weight_scale_inv` (float32, [ceil(N / bn), ceil(K / bk)]): every bn x bk tile of W is its FP8
values times that tile's scale (edge tiles are partial). The config says so with
`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [bn, bk],
activation_scheme: dynamic}`. MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss) are no FP8 format:
their `*_blocks` / `*_scales` tensors say what they are by name and the reader dequantizes them
(mxfp4_format.py), so for them this returns None, as for AWQ and GPTQ (int4: awq_format.py, gptq_format.py)
and for compressed-tensors' and fbgemm's row-wise FP8 (compressed_tensors_format.py, fbgemm_fp8_format.py;
`stored_blocks` says which column block keeps those as stored).
Any other quantization_config changes what the stored numbers mean in a way this runtime does not
implement, so it is refused by name instead of loaded wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.weights.quantization.compressed_tensors_format import (QUANT_METHOD as COMPRESSED_TENSORS,
                                                                        fp8_block_structure, quantization_config_dict)
from moe_runtime.weights.quantization.fbgemm_fp8_format import QUANT_METHOD as FBGEMM_FP8
from moe_runtime.weights.quantization.mxfp4_format import QUANT_METHOD as MXFP4_METHOD
from moe_runtime.weights.quantization.awq_format import QUANT_METHOD as AWQ_METHOD
from moe_runtime.weights.quantization.gptq_format import QUANT_METHOD as GPTQ_METHOD

SCALE_SUFFIX = "_scale_inv"        # `x.weight` is scaled by `x.weight_scale_inv`
FP8_MAX = 448.0                    # the largest finite float8_e4m3fn
E4M3_NAMES = frozenset({"e4m3", "float8_e4m3fn"})   # DeepSeek's name, and MiniMax-M2's (the torch dtype's)


@dataclass(frozen=True)
class Fp8BlockFormat:
    block_rows: int = 128
    block_cols: int = 128

    @classmethod
    def from_hf_config(cls, hf_config, where: str) -> "Fp8BlockFormat | None":
        """The format `hf_config.quantization_config` declares; None for an unquantized checkpoint."""
        quant = getattr(hf_config, "quantization_config", None)
        if quant is None:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
        method = quant.get("quant_method")
        if method in (MXFP4_METHOD, COMPRESSED_TENSORS, AWQ_METHOD, GPTQ_METHOD, FBGEMM_FP8):   # read by name or
            return None                                                                       # by their formats
        if method != "fp8":
            raise CheckpointError(f"{where}: quantization_config.quant_method={method!r} is not supported (only "
                                  f"'fp8' block-quantized, 'mxfp4', 'compressed-tensors', 'awq', 'gptq' and "
                                  f"'fbgemm_fp8' checkpoints load; dequantize the checkpoint first)")
        if quant.get("fmt", "e4m3") not in E4M3_NAMES:
            raise CheckpointError(f"{where}: quantization_config.fmt={quant.get('fmt')!r} is not supported (only "
                                  f"e4m3: {', '.join(sorted(E4M3_NAMES))})")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(f"{where}: quantization_config.activation_scheme={quant.get('activation_scheme')!r} "
                                  f"is not supported (only 'dynamic': static activation scales are not read)")
        block = quant.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(f"{where}: quantization_config.weight_block_size={block!r} must be two positive "
                                  f"integers (per-tensor and per-channel FP8 are not supported)")
        return cls(block[0], block[1])

    @classmethod
    def stored_blocks(cls, hf_config, where: str) -> "Fp8BlockFormat | None":
        """The blocks a checkpoint's FP8 weights are cut in, whatever its format: what `--quantization fp8` must
        keep (its column block becomes the engine's) for them to stay as stored. DeepSeek-style blocks
        (`from_hf_config`) or compressed-tensors' `block` strategy; None where every FP8 scale covers whole rows
        (per tensor, per channel, fbgemm's row-wise: any column block keeps them) or nothing is FP8."""
        fmt = cls.from_hf_config(hf_config, where)
        if fmt is not None:
            return fmt
        block = fp8_block_structure(quantization_config_dict(hf_config))
        return cls(*block) if block else None

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = weight_shape
        return (-(-rows // self.block_rows), -(-cols // self.block_cols))

    def check_scale_shape(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> None:
        if weight.dim() != 2 or tuple(scale_inv.shape) != self.scale_shape(tuple(weight.shape)):
            raise CheckpointError(f"{name}: FP8 weight of shape {tuple(weight.shape)} needs {name}{SCALE_SUFFIX} of "
                                  f"shape {self.scale_shape(tuple(weight.shape)) if weight.dim() == 2 else '?'} "
                                  f"for {self.block_rows}x{self.block_cols} blocks, got {tuple(scale_inv.shape)}")

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
        """float32 [N, K] from FP8 values [N, K] and block scales [ceil(N/bn), ceil(K/bk)]."""
        self.check_scale_shape(weight, scale_inv, name)
        rows, cols = weight.shape
        scales = scale_inv.float().repeat_interleave(self.block_rows, 0)[:rows]       # [N, ceil(K/bk)]
        scales = scales.repeat_interleave(self.block_cols, 1)[:, :cols]               # [N, K]
        return weight.float() * scales

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 values [N, K], block scales) with each block's largest magnitude at FP8_MAX."""
        rows, cols = weight.shape
        scale_rows, scale_cols = self.scale_shape((rows, cols))
        padded = weight.float().new_zeros(scale_rows * self.block_rows, scale_cols * self.block_cols)
        padded[:rows, :cols] = weight.float()
        blocks = padded.view(scale_rows, self.block_rows, scale_cols, self.block_cols)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)                          # [Sr, Sc]
        scale_inv = amax / FP8_MAX
        values = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
        return values.to(torch.float8_e4m3fn), scale_inv
