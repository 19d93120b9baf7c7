"""Random FP8 block-scaled weights in the runtime's layout, for the FP8 kernel tests of every family.

Weights are random fp32 quantized the way a checkpoint is (`Fp8BlockFormat.quantize`: block scales
[ceil(N/bn), ceil(K/bk)]), then the scales are expanded along rows ([N, ceil(K/bk)]), as the loader
does. Shapes are chosen so both dims end in partial blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat

BLOCK_ROWS = 16      # the checkpoint's row block: rows of the expanded scales repeat in runs of this


@dataclass(frozen=True)
class Fp8Weight:
    values: torch.Tensor   # [..., N, K] float8_e4m3fn
    scale: torch.Tensor    # [..., N, ceil(K / block_k)] float32


@dataclass(frozen=True)
class Fp8Experts:
    w13: Fp8Weight         # [E, 2I, H]
    w2: Fp8Weight          # [E, H, I]
    block_k: int

    def args(self) -> tuple:
        """The weight arguments of fp8_expert_mlp / fp8_masked_expert_mlp, in order."""
        return self.w13.values, self.w13.scale, self.w2.values, self.w2.scale, self.block_k


def quantize_rows(weight: torch.Tensor, block_k: int) -> Fp8Weight:
    """fp32 [N, K] -> FP8 values and row-expanded scales, through the checkpoint's block format."""
    values, block_scales = Fp8BlockFormat(BLOCK_ROWS, block_k).quantize(weight)
    scale = block_scales.repeat_interleave(BLOCK_ROWS, 0)[:weight.shape[0]].contiguous()   # [N, Kb]
    return Fp8Weight(values, scale)


def random_fp8_weight(rows: int, cols: int, block_k: int, generator: torch.Generator) -> Fp8Weight:
    """Entries ~ N(0, 1/cols) so a layer's outputs are O(1) for O(1) inputs; rows of varied magnitude
    make the blocks' scales differ."""
    weight = torch.randn(rows, cols, generator=generator) / cols ** 0.5
    weight *= torch.rand(rows, 1, generator=generator) + 0.5
    return quantize_rows(weight, block_k)


def random_fp8_experts(experts: int, hidden: int, intermediate: int, block_k: int,
                       generator: torch.Generator) -> Fp8Experts:
    w13 = [random_fp8_weight(2 * intermediate, hidden, block_k, generator) for _ in range(experts)]
    w2 = [random_fp8_weight(hidden, intermediate, block_k, generator) for _ in range(experts)]
    return Fp8Experts(stack_weights(w13), stack_weights(w2), block_k)


def stack_weights(parts: list[Fp8Weight]) -> Fp8Weight:
    return Fp8Weight(torch.stack([p.values for p in parts]), torch.stack([p.scale for p in parts]))


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other column of a wider tensor)."""
    wide = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


def all_e4m3_codes() -> torch.Tensor:
    """[16, 16] float8_e4m3fn holding each of the 256 codes once (NaN 0x7F/0xFF, subnormals, -0)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
