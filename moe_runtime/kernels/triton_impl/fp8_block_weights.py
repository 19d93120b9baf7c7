"""Triton twins of moe_runtime/kernels/fp8_block_weights.py: the grouped GEMM reading FP8 weights tile by tile.

The weights never exist dequantized: each BLOCK_K x BLOCK_N tile is converted and scaled in
registers (grouped_gemm.load_weight_tile), or, in the FP8-activation scheme (sm89+), multiplied as
FP8 against activations quantized per token and 128 columns (grouped_gemm.fp8_block_dot). Which one
is the kernel set's `Fp8Scheme` (fp8_scheme.py), fixed when `Fp8Kernels` is built. A dense linear is
the grouped GEMM with one expert over a schedule of consecutive rows. Outputs are in the
activations' dtype; tl.dot accumulates in fp32 and the SwiGLU activation between the two expert
projections is stored in the activations' dtype (as the unquantized Triton expert MLP does).

Precision: the dequantize path multiplies the exact dequantized weight (cast to the activations'
dtype); the FP8-activation path also rounds each activation to e4m3 within its 1x128 group (relative
error up to 2^-4 per entry), which the torch twins do not: its results match a reference that
quantizes the activations the same way (tests/fp8_activation_reference.py), not the twins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..expert_mlp import check_sorted_counts
from ..fp8_block_weights import check_fp8_expert_weights, check_fp8_linear
from .align import BlockSchedule
from .fp8_activations import quantize_activations
from .fp8_scheme import Fp8Scheme
from .grouped_gemm import BlockScales, masked_experts, pick_block_m, run_grouped_gemm, sorted_experts
from .masked_layout import check_masked_layout


def dense_schedule(num_rows: int, block_m: int, device: torch.device) -> BlockSchedule:
    """Rows 0..num_rows-1 of one expert (expert 0) in BLOCK_M tiles; built on the device, no kernel launch."""
    padded = triton.cdiv(num_rows, block_m) * block_m
    slots = torch.arange(padded, device=device)                            # [P]
    return BlockSchedule(
        padded_rows=torch.where(slots < num_rows, slots, -1),
        block_expert=torch.zeros(padded // block_m, dtype=torch.int32, device=device),
        block_m=block_m,
    )


@dataclass(frozen=True)
class Fp8Kernels:
    """The Triton family's FP8 fields (KernelSet.fp8_linear, fp8_expert_mlp, fp8_masked_expert_mlp) for one scheme."""

    scheme: Fp8Scheme

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype."""
        check_fp8_linear(x, weight, scale, block_k)
        return self.linear_prechecked(x, weight, scale, block_k, bias)

    def linear_prechecked(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear` for a weight whose fixed properties were checked once, at load (Fp8InMemory)."""
        num_rows, out_features = math.prod(x.shape[:-1]), weight.shape[0]
        a = x.reshape(num_rows, x.shape[-1])                              # [T, K], strides passed to the kernel
        out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)  # [T, N]
        if weight.shape[1] == 0:
            out.zero_()
        else:
            schedule = dense_schedule(num_rows, pick_block_m(num_rows, 1), x.device)
            scales = BlockScales(scale.unsqueeze(0), block_k)
            dot_block_k = self.scheme.dot_block_k(weight.shape[1], block_k)
            if dot_block_k is not None:
                a = quantize_activations(a, self.scheme)
            run_grouped_gemm(a, self.scheme.weight_operand(weight).unsqueeze(0), out, schedule, swiglu=False,
                             gather_a=False, scatter_out=False, scales=scales, dot_block_k=dot_block_k)
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], out_features)

    def expert_mlp(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:
        """expert_mlp with FP8 w13 [E, 2I, H] / w2 [E, H, I] and their row-expanded scales: [N, H] -> [N, H]."""
        check_fp8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
        check_sorted_counts(x_sorted, counts, w13.shape[0])
        return sorted_experts(x_sorted, counts, self.scheme.weight_operand(w13), self.scheme.weight_operand(w2),
                              w13_scales=BlockScales(w13_scale, block_k), w2_scales=BlockScales(w2_scale, block_k),
                              scheme=self.scheme)

    def masked_expert_mlp(self, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                          w2: torch.Tensor, w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:
        """masked_expert_mlp with FP8 weights: [E, M, H] -> [E, M, H]; rows past counts[e] are never read and
        UNDEFINED in the output; counts stay on the device (masked_layout.py)."""
        check_fp8_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
        check_masked_layout(x, counts, w13.shape[0])
        return masked_experts(x, counts, self.scheme.weight_operand(w13), self.scheme.weight_operand(w2),
                              w13_scales=BlockScales(w13_scale, block_k), w2_scales=BlockScales(w2_scale, block_k),
                              scheme=self.scheme)
