"""Triton twins of moe_runtime/kernels/mxfp4_weights.py: the grouped GEMM decoding MXFP4 weight tiles in registers.

The weights never exist dequantized: each BLOCK_K x BLOCK_N tile's bytes and e8m0 exponents are
decoded to fp32 (mxfp4_tiles.py), cast to the activations' dtype and fed to tl.dot, as FP8's
dequantize path does. Activations stay in their dtype (no MXFP4 activations: the published gpt-oss
checkpoints quantize weights only). A dense linear is the grouped GEMM with one expert over a schedule
of consecutive rows. Outputs are in the activations' dtype.
"""
from __future__ import annotations

import math

import torch

from ..expert_activation import ExpertActivation, add_bias_
from ..expert_mlp import check_expert_biases, check_sorted_counts
from ..mxfp4_weights import check_mxfp4_expert_weights, check_mxfp4_weight
from .fp8_block_weights import dense_schedule
from .grouped_gemm import Mxfp4Scales, masked_experts, pick_block_m, run_grouped_gemm, sorted_experts
from .masked_layout import check_masked_layout


def mxfp4_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype."""
    check_mxfp4_weight(values, scales, x.shape[-1])
    num_rows, out_features = math.prod(x.shape[:-1]), values.shape[0]
    a = x.reshape(num_rows, x.shape[-1])                                  # [T, K]
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)   # [T, N]
    if x.shape[-1] == 0:
        out.zero_()
    else:
        schedule = dense_schedule(num_rows, pick_block_m(num_rows, 1), x.device)
        run_grouped_gemm(a, values.unsqueeze(0), out, schedule, swiglu=False, gather_a=False, scatter_out=False,
                         scales=Mxfp4Scales(scales.unsqueeze(0)))
    return add_bias_(out, bias).view(*x.shape[:-1], out_features)


def mxfp4_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                     w2: torch.Tensor, w2_scale: torch.Tensor, *, b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None, activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """expert_mlp with MXFP4 w13 [E, 2I, packed(H)] / w2 [E, H, packed(I)] and e8m0 scales: [N, H] -> [N, H]."""
    check_mxfp4_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale)
    check_expert_biases(w13, w2, b13, b2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return sorted_experts(x_sorted, counts, w13, w2, w13_scales=Mxfp4Scales(w13_scale), w2_scales=Mxfp4Scales(w2_scale),
                          b13=b13, b2=b2, activation_kind=activation)


def mxfp4_masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                            w2: torch.Tensor, w2_scale: torch.Tensor, *, b13: torch.Tensor | None = None,
                            b2: torch.Tensor | None = None,
                            activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """masked_expert_mlp with MXFP4 weights: [E, M, H] -> [E, M, H]; rows past counts[e] UNDEFINED."""
    check_mxfp4_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale)
    check_expert_biases(w13, w2, b13, b2)
    check_masked_layout(x, counts, w13.shape[0])
    return masked_experts(x, counts, w13, w2, w13_scales=Mxfp4Scales(w13_scale), w2_scales=Mxfp4Scales(w2_scale),
                          b13=b13, b2=b2, activation_kind=activation)
