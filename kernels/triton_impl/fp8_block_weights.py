"""Triton twins of kernels/fp8_block_weights.py: the grouped GEMM reading FP8 weights tile by tile.

The weights never exist dequantized: each BLOCK_K x BLOCK_N tile is converted and scaled in
registers (grouped_gemm.load_weight_tile). A dense linear is the grouped GEMM with one expert over
a schedule of consecutive rows. Outputs are in the activations' dtype; tl.dot accumulates in fp32
and the SwiGLU activation between the two expert projections is stored in the activations' dtype
(as the unquantized Triton expert MLP does).
"""
from __future__ import annotations

import math

import torch
import triton

from ..expert_mlp import check_masked_counts, check_sorted_counts
from ..fp8_block_weights import check_fp8_expert_weights, check_fp8_weight
from .align import BlockSchedule
from .fp8_e4m3 import fp8_operand
from .grouped_gemm import BlockScales, masked_experts, pick_block_m, run_grouped_gemm, sorted_experts


def dense_schedule(num_rows: int, block_m: int, device: torch.device) -> BlockSchedule:
    """Rows 0..num_rows-1 of one expert (expert 0) in BLOCK_M tiles; built on the device, no kernel launch."""
    padded = triton.cdiv(num_rows, block_m) * block_m
    slots = torch.arange(padded, device=device)                            # [P]
    return BlockSchedule(
        padded_rows=torch.where(slots < num_rows, slots, -1),
        block_expert=torch.zeros(padded // block_m, dtype=torch.int32, device=device),
        block_m=block_m,
    )


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype."""
    check_fp8_weight(weight, scale, block_k)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] and [N, K]")
    num_rows, out_features = math.prod(x.shape[:-1]), weight.shape[0]
    a = x.reshape(num_rows, x.shape[-1])                                  # [T, K], strides passed to the kernel
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)  # [T, N]
    if weight.shape[1] == 0:
        out.zero_()
    else:
        schedule = dense_schedule(num_rows, pick_block_m(num_rows, 1), x.device)
        run_grouped_gemm(a, fp8_operand(weight).unsqueeze(0), out, schedule, swiglu=False, gather_a=False,
                         scatter_out=False, scales=BlockScales(scale.unsqueeze(0), block_k))
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], out_features)


def fp8_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """expert_mlp with FP8 w13 [E, 2I, H] / w2 [E, H, I] and their row-expanded scales: [N, H] -> [N, H]."""
    check_fp8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return sorted_experts(x_sorted, counts, fp8_operand(w13), fp8_operand(w2),
                          w13_scales=BlockScales(w13_scale, block_k), w2_scales=BlockScales(w2_scale, block_k))


def fp8_masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                          w2: torch.Tensor, w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """masked_expert_mlp with FP8 weights: [E, M, H] -> [E, M, H], rows past counts[e] zero and never read."""
    check_fp8_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
    check_masked_counts(x, counts, w13.shape[0])
    return masked_experts(x, counts, fp8_operand(w13), fp8_operand(w2),
                          w13_scales=BlockScales(w13_scale, block_k), w2_scales=BlockScales(w2_scale, block_k))
