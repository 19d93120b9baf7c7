"""The FP8-activation scheme's math in float64 (DeepGEMM's: activations 1x128, weights in blocks):
what the Triton grouped GEMM computes on sm89+ GPUs and, with the dot emulated, in the interpreter.

Each projection's input is quantized per token and 128 columns exactly as the kernel does
(moe_runtime/dispatch/fp8_activations.py's `quantize_token_groups`, which the Triton quantizer matches bit for
bit), dequantized, and multiplied by the dequantized weight in float64. Between the two expert
projections the SwiGLU activation is rounded to the activations' dtype (the kernel stores it so)
before it is quantized. Results are float64; the kernels' only departures are fp32 accumulation and,
in 16-bit dtypes, the output's rounding.

Weights are dequantized one expert at a time (gpu_check runs this at DeepSeek-V3's shapes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime.dispatch.fp8_activations import dequantize, quantize_token_groups
from moe_runtime.kernels.fp8_block_weights import dequantize_rows

REFERENCE_DTYPE = torch.float64


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> its 1x128-group FP8 quantization, dequantized in float64."""
    return dequantize(quantize_token_groups(x), REFERENCE_DTYPE)


def fp8_activation_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [T, K] quantized @ dequantized weight [N, K].T -> [T, N] float64."""
    return quantized(x) @ dequantize_rows(weight, scale, block_k, REFERENCE_DTYPE).T


def fp8_activation_swiglu(x, w13, w13_scale, w2, w2_scale, block_k) -> torch.Tensor:
    """One expert: x [n, H] in the activations' dtype -> [n, H] float64."""
    gate_up = fp8_activation_linear(x, w13, w13_scale, block_k)            # [n, 2I]
    intermediate = gate_up.shape[1] // 2
    activation = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    return fp8_activation_linear(activation.to(x.dtype), w2, w2_scale, block_k)


def fp8_activation_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, block_k) -> torch.Tensor:
    """The contiguous layout: [N, H] rows grouped by expert -> [N, H] float64."""
    out = torch.zeros(x_sorted.shape, dtype=REFERENCE_DTYPE, device=x_sorted.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start:start + count] = fp8_activation_swiglu(x_sorted[start:start + count], w13[expert],
                                                             w13_scale[expert], w2[expert], w2_scale[expert], block_k)
        start += count
    return out


def fp8_activation_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, block_k) -> torch.Tensor:
    """The masked layout: [E, M, H] -> [E, M, H] float64, zero past each count (which no kernel promises)."""
    out = torch.zeros(x.shape, dtype=REFERENCE_DTYPE, device=x.device)
    for expert, count in enumerate(counts.tolist()):
        count = min(max(count, 0), x.shape[1])
        if count:
            out[expert, :count] = fp8_activation_swiglu(x[expert, :count], w13[expert], w13_scale[expert],
                                                        w2[expert], w2_scale[expert], block_k)
    return out
