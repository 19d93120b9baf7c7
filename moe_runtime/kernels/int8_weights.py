"""Int8 weight-only kernels (`--quantization int8`): one fp32 scale per output row (the torch family).

Layout: `weight` int8 [..., N, K] holding round(w / scale) in [-127, 127] and `scale` float32 [..., N];
dequantized weight = weight.float() * scale[..., None]. Activations stay in their dtype: weight-only.

How a matmul runs: x @ (q * s).T == (x @ q.T) * s, so each row chunk of the weight is only CONVERTED
to fp32 (int8 -> fp32 is exact) and multiplied, and the scales multiply the [T, N] output once. The
result is the dequantized weight's product up to fp32 rounding (one extra rounding per output). At
most CHUNK_BYTES of fp32 weight are held at once, in one scratch buffer reused chunk after chunk.

What was measured (docs/design.md, "int8 weight-only"), one thread of the 2-core AVX2 dev machine,
weight 4096 x 2048, best of 15-25 calls:
- torch's own int8 weight-only GEMM `aten._weight_int8pack_mm` (fp32 / bf16 / fp16 activations, the
  scales in the activations' dtype): 15 ms at T = 1, 148 ms at T = 16, against 2.0 ms and 6.7 ms for
  the chunked form below (this CPU has no AVX-512 / AMX, which its fast paths target). Not used.
- torch.compile of a fused dequantize-GEMV (inductor's C++ reduction): 21 ms at T = 1. Not used.
- chunked convert + matmul, chunks of 0.25 - 4 MiB: 2 MiB is within noise of 4 MiB and clearly ahead
  of smaller ones (per-chunk op overhead); one row goes through `torch.mv` on the chunk (gemv), more
  rows through `linear_rows` (the skinny-matmul rule).
Against the same weight in fp32 the chunked form is 1.1-1.2x slower at T = 1 (the conversion pass costs
about what reading 4x the bytes saves) and ~1.1-1.2x faster from T = 4 on; what it always buys is 4x
fewer weight bytes resident.

Compute dtype: fp32 on CPU whatever the activations' dtype (CPU BLAS without bf16 hardware is slower
in bf16, and fp32 keeps the product exact to the dequantized weight); the activations' dtype on other
devices (the Triton family uses these kernels: no Triton int8 kernel yet). Outputs: the activations'
dtype.
"""
from __future__ import annotations

import math

import torch

from .expert_mlp import (busy_segments, check_expert_weights, check_masked_counts, check_sorted_counts,
                         masked_segments, masked_through_padded, padded_layout_wins, segments_through_padded,
                         silu_and_mul)
from .chunked_weights import chunked_matmul, compute_dtype
from .skinny_matmul import batched_linear_rows

PADDED_CHUNK_BYTES = 4 << 20   # fp32 converted experts held at once by the padded all-experts form
INT8_MAX = 127                 # symmetric: -128 is never produced


def check_int8_weight(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> None:
    """Validate one int8 weight [..., N, K] and its per-row scales float32 [..., N]."""
    if weight.dtype != torch.int8:
        raise ValueError(f"{name} must be torch.int8, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{name} must be [..., N, K], got shape {tuple(weight.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(weight.shape[:-1]):
        raise ValueError(f"{name}_scale must be float32 {tuple(weight.shape[:-1])} (one scale per row of {name} "
                         f"{tuple(weight.shape)}), got {scale.dtype} {tuple(scale.shape)}")


def check_int8_expert_weights(hidden: int, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                              w2_scale: torch.Tensor) -> int:
    """Validate int8 `w13 [E, 2I, H]` / `w2 [E, H, I]` and their scales [E, 2I] / [E, H]; return I."""
    intermediate = check_expert_weights(hidden, w13, w2)
    check_int8_weight(w13, w13_scale, "w13")
    check_int8_weight(w2, w2_scale, "w2")
    return intermediate


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole dequantized weight [..., N, K] (for tests and the reference family: matmuls never build it)."""
    check_int8_weight(weight, scale)
    return (weight.float() * scale.unsqueeze(-1)).to(dtype)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ (weight [N, K] * scale [N, 1]).T -> [T, N] in compute_dtype(x), CHUNK_BYTES of weight at a time."""
    def convert(rows: torch.Tensor, start: int, stop: int) -> None:
        rows.copy_(weight[start:stop])                                     # exact: |q| <= 127

    out = chunked_matmul(x, weight.shape[0], convert)
    return out.mul_(scale.to(out.dtype))                                  # the scales, once per output


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype, never dequantizing it whole."""
    check_int8_weight(weight, scale)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"int8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] and "
                         f"[N, K]")
    out = int8_matmul(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), weight, scale)   # [T, N]
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def int8_swiglu(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor) -> torch.Tensor:
    """One expert: w2 @ (silu(gate) * up) for x [n, H], w13 [2I, H], w2 [H, I] -> [n, H] in compute_dtype(x)."""
    activated = silu_and_mul(int8_matmul(x, w13, w13_scale))             # [n, I]
    return int8_matmul(activated, w2, w2_scale)


def int8_swiglu_padded(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                       w2_scale: torch.Tensor) -> torch.Tensor:
    """All experts on the masked layout x [E, M, H] -> [E, M, H] in compute_dtype(x), a few experts at a time.

    Decode on CPU (few rows on most experts): a loop over busy experts costs a dozen small ops per
    expert, so like `expert_mlp`'s padded form this runs batched matmuls, over groups of experts whose
    converted weights fit PADDED_CHUNK_BYTES (measured at the bench's 32 x 512 x 256 experts, 1-4 rows
    each, on a shared and noisy machine: 1.6-1.9x faster than the loop, 4 MiB ahead of 2 and 8 MiB).
    Rows past a count are computed too.
    """
    dtype = compute_dtype(x)
    experts = w13.shape[0]
    x = x.to(dtype)
    out = torch.empty(experts, x.shape[1], w2.shape[1], dtype=dtype, device=x.device)   # [E, M, H]
    group = max(1, min(experts, PADDED_CHUNK_BYTES // (4 * max(w13[0].numel(), w2[0].numel(), 1))))
    scratch13 = torch.empty(group, *w13.shape[1:], dtype=dtype, device=x.device)       # [g, 2I, H]
    scratch2 = torch.empty(group, *w2.shape[1:], dtype=dtype, device=x.device)         # [g, H, I]
    for start in range(0, experts, group):
        stop = min(start + group, experts)
        gate_up = scratch13[:stop - start]
        gate_up.copy_(w13[start:stop])
        activated = silu_and_mul(batched_linear_rows(x[start:stop], gate_up) * w13_scale[start:stop, None, :])
        down = scratch2[:stop - start]
        down.copy_(w2[start:stop])
        out[start:stop] = batched_linear_rows(activated, down) * w2_scale[start:stop, None, :]
    return out


def int8_expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H] int8
    w13_scale: torch.Tensor,  # [E, 2I] float32
    w2: torch.Tensor,         # [E, H, I] int8
    w2_scale: torch.Tensor,   # [E, H] float32
) -> torch.Tensor:            # [N, H] in x_sorted.dtype, unweighted
    """expert_mlp with int8 weights: busy experts only, each one's weights converted chunk by chunk, or
    (decode-sized segments on most experts, `padded_layout_wins`) the padded all-experts form."""
    check_int8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale)
    ends = check_sorted_counts(x_sorted, counts, w13.shape[0])             # [E]
    max_count = int(counts.max()) if counts.numel() else 0
    if padded_layout_wins(counts, max_count):
        def all_experts(padded: torch.Tensor) -> torch.Tensor:
            return int8_swiglu_padded(padded, w13, w13_scale, w2, w2_scale)

        return segments_through_padded(x_sorted, counts, ends, max_count, all_experts).to(x_sorted.dtype)  # [N, H]
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    for seg in busy_segments(counts, ends):
        e = seg.expert
        out[seg.start:seg.end] = int8_swiglu(x_sorted[seg.start:seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e])
    return out


def int8_masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H] int8
    w13_scale: torch.Tensor,  # [E, 2I] float32
    w2: torch.Tensor,         # [E, H, I] int8
    w2_scale: torch.Tensor,   # [E, H] float32
) -> torch.Tensor:            # [E, M, H] in x.dtype, rows past counts[e] zero
    """masked_expert_mlp with int8 weights; stale rows past counts[e] are never read (they may hold NaN)."""
    check_int8_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale)
    max_count = check_masked_counts(x, counts, w13.shape[0])
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    if padded_layout_wins(counts, max_count):
        masked_through_padded(out, x, counts, max_count,
                              lambda padded: int8_swiglu_padded(padded, w13, w13_scale, w2, w2_scale))
        return out
    for seg in masked_segments(counts):
        e = seg.expert
        out[e, :seg.end] = int8_swiglu(x[e, :seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e])
    return out
