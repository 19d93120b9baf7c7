"""FP8 activations with per-token-group scales, the way DeepEP quantizes what it dispatches.

Each token's hidden vector is cut into groups of GROUP_SIZE (128) columns; every group gets one
float32 scale, amax / 448 (448 is float8_e4m3fn's largest value), and its values are stored as
e4m3fn, value / scale. The largest entry of a group lands on +-448, so the group uses the whole
e4m3 range whatever its magnitude; a token's groups are independent, so one outlier costs
precision in its own 128 columns only.

Precision: e4m3 has 3 mantissa bits, so a dequantized entry is within 2**-4 of the original,
relatively, when it is at least 2**-6 * scale (e4m3's smallest normal); below that (the group's
subnormal range) the error is at most 2**-10 * scale, absolutely.

Two choices follow DeepEP's kernels (csrc/kernels/legacy/utils.cuh, `calculate_fp8_scales`):
amax is floored at AMAX_FLOOR (kFP8Margin = 1e-4) so an all-zero group gets a finite, non-zero
scale, and values are x * (448 / amax), saturated to +-448. DeepEP's FP8 dispatch needs hidden
sizes divisible by 128; here the last group may be partial (H % 128 columns) so the non-DeepEP
backends can quantize any hidden size.
"""

from __future__ import annotations

import dataclasses
import math

import torch

GROUP_SIZE = 128          # hidden columns per scale
FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0          # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4         # DeepEP's kFP8Margin: all-zero groups get scale AMAX_FLOOR / E4M3_MAX


@dataclasses.dataclass(frozen=True)
class Fp8Activations:
    """Quantized hidden states: entry j of a row is values[..., j] * scales[..., j // GROUP_SIZE]."""

    values: torch.Tensor  # [..., H] float8_e4m3fn
    scales: torch.Tensor  # [..., ceil(H / GROUP_SIZE)] float32


def num_groups(hidden_size: int) -> int:
    """Scales per token: ceil(hidden_size / GROUP_SIZE), the last group possibly partial."""
    return math.ceil(hidden_size / GROUP_SIZE)


def quantize_token_groups(x: torch.Tensor) -> Fp8Activations:
    """x [T, H] (any float dtype) -> values [T, H] e4m3fn and scales [T, ceil(H / 128)] float32."""
    if x.dim() != 2:
        raise ValueError(f"quantize_token_groups: x must be [T, H], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    groups = num_groups(hidden)
    # Zero padding of a partial last group leaves its amax as that of its real columns.
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * GROUP_SIZE - hidden))
    grouped = padded.view(num_tokens, groups, GROUP_SIZE)                     # [T, G, 128]
    amax = grouped.abs().amax(dim=2).clamp(min=AMAX_FLOOR)                    # [T, G]
    scaled = (grouped * (E4M3_MAX / amax).unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.view(num_tokens, groups * GROUP_SIZE)[:, :hidden].to(FP8_DTYPE)   # [T, H]
    return Fp8Activations(values=values, scales=amax / E4M3_MAX)


def dequantize(activations: Fp8Activations, dtype: torch.dtype) -> torch.Tensor:
    """values [..., H] * their group's scale -> [..., H] in `dtype` (any leading dims, any
    scale strides: DeepEP's low-latency scales are column-major in their last two dims)."""
    values, scales = activations.values, activations.scales
    hidden, groups = values.shape[-1], scales.shape[-1]
    if groups != num_groups(hidden) or values.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"dequantize: scales {tuple(scales.shape)} do not match values "
                         f"{tuple(values.shape)} in groups of {GROUP_SIZE}")
    padded = torch.nn.functional.pad(values.to(torch.float32), (0, groups * GROUP_SIZE - hidden))
    grouped = padded.unflatten(-1, (groups, GROUP_SIZE))                      # [..., G, 128]
    restored = (grouped * scales.to(torch.float32).unsqueeze(-1)).flatten(-2)  # [..., G * 128]
    return restored[..., :hidden].to(dtype)
