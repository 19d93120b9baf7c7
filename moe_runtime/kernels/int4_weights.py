"""Int4 weight-only kernels (`--quantization int4`): packed codes decoded one row chunk at a time (the torch family).

Layout: moe_runtime/kernels/int4_layout.py (`Int4Layout`): values uint8 [..., N, ceil(K/2)] (two unsigned codes a
byte, low nibble first), float32 scales [..., N, G] (symmetric, zero point 8) or [..., N, G, 2] (scale, zero point),
groups of `group_size` consecutive input columns or, with act order, the groups `column_groups` [..., K] names.
The kernels take the layout as an argument: one engine keeps one int4 layout for all its experts.

How a matmul runs: like FP8 and MXFP4, `chunked_weights.chunked_matmul` walks the weight's output rows in chunks of
at most CHUNK_BYTES of fp32 and has `decode_int4_into` write each chunk's dequantized rows into one float32 scratch
buffer: nibbles converted (exact), the zero point subtracted (an exact small integer) and one multiply by the
group's scale, which is `dequantize_int4`'s rule, so the product is the dequantized weight's up to fp32 summation
order. Contiguous groups decode through a reshape to [rows, groups, group_size] and a broadcast of the scales (the
last, partial group apart); column groups (GPTQ act order) select each column's scale and zero point. The weight is
never widened whole.

Decode-sized batches on most experts (`expert_mlp.padded_layout_wins`) run the padded all-experts form, as int8
does: a few experts' weights decoded at once into PADDED_CHUNK_BYTES of fp32, then two batched matmuls.

Device-agnostic torch: the Triton family uses these kernels too (no Triton int4 kernel yet). Compute dtype
(`chunked_weights.compute_dtype`): fp32 on CPU, the activations' dtype elsewhere; outputs in the activations' dtype.
"""
from __future__ import annotations

import math

import torch

from .chunked_weights import chunked_matmul, compute_dtype
from .expert_mlp import (busy_segments, check_masked_counts, check_sorted_counts, masked_segments,
                         masked_through_padded, padded_layout_wins, segments_through_padded, silu_and_mul)
from .int4_layout import SYMMETRIC_ZERO, Int4Layout, check_int4_weight, packed_int4_columns
from .skinny_matmul import batched_linear_rows

PADDED_CHUNK_BYTES = 4 << 20   # fp32 decoded experts held at once by the padded all-experts form (int8's measure)


def check_int4_expert_weights(hidden: int, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                              w2_scale: torch.Tensor, layout: Int4Layout, w13_groups: torch.Tensor | None,
                              w2_groups: torch.Tensor | None) -> int:
    """Validate int4 w13 [E, 2I, ceil(H/2)] / w2 [E, H, ceil(I/2)], their scales and column groups; return I."""
    if w13.dim() != 3 or w13.shape[1] % 2 or w2.dim() != 3 or tuple(w2.shape[:2]) != (w13.shape[0], hidden):
        raise ValueError(f"int4 w13 must be [E, 2I, {packed_int4_columns(hidden)}] and w2 [E, H={hidden}, *], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    intermediate = w13.shape[1] // 2
    check_int4_weight(layout, w13, w13_scale, hidden, w13_groups, "w13")
    check_int4_weight(layout, w2, w2_scale, intermediate, w2_groups, "w2")
    return intermediate


def scale_and_shift(out: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
    """out = (out - zero) * scale in place, the group's zero point and scale broadcast over its columns (None: the
    symmetric zero point)."""
    if zero is None:
        out.sub_(SYMMETRIC_ZERO)
    else:
        out.sub_(zero)
    out.mul_(scale)


def decode_int4_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, layout: Int4Layout,
                     column_groups: torch.Tensor | None = None) -> None:
    """out [..., R, K] float32 (contiguous) = the dequantized rows of values [..., R, ceil(K/2)] and their scales
    [..., R, G(, 2)]; `column_groups` [..., K] where the layout has them."""
    columns = out.shape[-1]
    out[..., 0::2] = values & 0x0F                                          # low nibbles, then high: exact in fp32
    out[..., 1::2] = values[..., :columns // 2] >> 4
    scale, zero = (scales[..., 0], scales[..., 1]) if layout.zero_points else (scales, None)   # [..., R, G]
    if column_groups is not None and column_groups.dim() > 1:               # one weight's groups at a time
        for index in range(out.shape[0]):
            decode_int4_into(out[index], values[index], scales[index], layout, column_groups[index])
        return
    if column_groups is not None:    # act order: each column's group (index_select: 3x faster than a gather here)
        index = column_groups.long()                                        # [K]
        scale_and_shift(out, scale.index_select(-1, index), None if zero is None else zero.index_select(-1, index))
        return
    size = columns if layout.group_size is None else layout.group_size
    whole = columns // size                                                 # groups of `size` columns
    body = out[..., :whole * size].unflatten(-1, (whole, size))             # [..., R, whole, size] (a view)
    scale_and_shift(body, scale[..., :whole, None], None if zero is None else zero[..., :whole, None])
    if whole * size < columns:                                              # the last, partial group
        scale_and_shift(out[..., whole * size:], scale[..., whole:whole + 1],
                        None if zero is None else zero[..., whole:whole + 1])


def int4_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, layout: Int4Layout,
                column_groups: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ dequantized(values [N, ceil(K/2)]).T -> [T, N] in compute_dtype(x), CHUNK_BYTES of weight at a
    time."""
    def decode(rows: torch.Tensor, start: int, stop: int) -> None:
        decode_int4_into(rows, values[start:stop], scales[start:stop], layout, column_groups)

    return chunked_matmul(x, values.shape[0], decode, scratch_dtype=torch.float32)


def int4_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, layout: Int4Layout,
                bias: torch.Tensor | None = None, column_groups: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype, never dequantizing it whole."""
    check_int4_weight(layout, values, scales, x.shape[-1], column_groups)
    if values.dim() != 2:
        raise ValueError(f"int4_linear: values must be [N, ceil(K/2)], got {tuple(values.shape)}")
    out = int4_matmul(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), values, scales, layout, column_groups)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], values.shape[0])


def int4_swiglu(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor, layout: Int4Layout, w13_groups: torch.Tensor | None,
                w2_groups: torch.Tensor | None) -> torch.Tensor:
    """One expert: w2 @ (silu(gate) * up) for x [n, H], w13 [2I, ceil(H/2)], w2 [H, ceil(I/2)] -> [n, H] in
    compute_dtype(x)."""
    activated = silu_and_mul(int4_matmul(x, w13, w13_scale, layout, w13_groups))         # [n, I]
    return int4_matmul(activated, w2, w2_scale, layout, w2_groups)


def int4_swiglu_padded(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                       w2_scale: torch.Tensor, layout: Int4Layout, w13_groups: torch.Tensor | None,
                       w2_groups: torch.Tensor | None) -> torch.Tensor:
    """All experts on the masked layout x [E, M, H] -> [E, M, H] in compute_dtype(x), a few experts at a time (rows
    past a count are computed too): each group's weights decoded into PADDED_CHUNK_BYTES of fp32, then batched."""
    dtype = compute_dtype(x)
    experts, hidden = w13.shape[0], x.shape[-1]
    intermediate = w13.shape[1] // 2
    x = x.to(dtype)
    out = torch.empty(experts, x.shape[1], hidden, dtype=dtype, device=x.device)         # [E, M, H]
    group = max(1, min(experts, PADDED_CHUNK_BYTES // (4 * max(2 * intermediate * hidden, 1))))
    scratch13 = torch.empty(group, 2 * intermediate, hidden, dtype=torch.float32, device=x.device)  # [g, 2I, H]
    scratch2 = torch.empty(group, hidden, intermediate, dtype=torch.float32, device=x.device)       # [g, H, I]
    for start in range(0, experts, group):
        stop = min(start + group, experts)
        gate_up, down = scratch13[:stop - start], scratch2[:stop - start]
        decode_int4_into(gate_up, w13[start:stop], w13_scale[start:stop], layout,
                         None if w13_groups is None else w13_groups[start:stop])
        decode_int4_into(down, w2[start:stop], w2_scale[start:stop], layout,
                         None if w2_groups is None else w2_groups[start:stop])
        activated = silu_and_mul(batched_linear_rows(x[start:stop], gate_up.to(dtype)))   # [g, M, I]
        out[start:stop] = batched_linear_rows(activated, down.to(dtype))
    return out


def int4_expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, ceil(H/2)] uint8
    w13_scale: torch.Tensor,  # [E, 2I, G13(, 2)] float32
    w2: torch.Tensor,         # [E, H, ceil(I/2)] uint8
    w2_scale: torch.Tensor,   # [E, H, G2(, 2)] float32
    *,
    layout: Int4Layout,
    w13_groups: torch.Tensor | None = None,   # [E, H] int32 (act order)
    w2_groups: torch.Tensor | None = None,    # [E, I] int32 (act order)
) -> torch.Tensor:            # [N, H] in x_sorted.dtype, unweighted
    """expert_mlp with int4 weights: busy experts only, each one's weights decoded chunk by chunk, or (decode-sized
    segments on most experts, `padded_layout_wins`) the padded all-experts form."""
    check_int4_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups)
    ends = check_sorted_counts(x_sorted, counts, w13.shape[0])             # [E]
    max_count = int(counts.max()) if counts.numel() else 0
    if padded_layout_wins(counts, max_count):
        def all_experts(padded: torch.Tensor) -> torch.Tensor:
            return int4_swiglu_padded(padded, w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups)

        return segments_through_padded(x_sorted, counts, ends, max_count, all_experts).to(x_sorted.dtype)  # [N, H]
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    for seg in busy_segments(counts, ends):
        e = seg.expert
        out[seg.start:seg.end] = int4_swiglu(x_sorted[seg.start:seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e],
                                             layout, None if w13_groups is None else w13_groups[e],
                                             None if w2_groups is None else w2_groups[e])
    return out


def int4_masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, ceil(H/2)] uint8
    w13_scale: torch.Tensor,  # [E, 2I, G13(, 2)] float32
    w2: torch.Tensor,         # [E, H, ceil(I/2)] uint8
    w2_scale: torch.Tensor,   # [E, H, G2(, 2)] float32
    *,
    layout: Int4Layout,
    w13_groups: torch.Tensor | None = None,   # [E, H] int32 (act order)
    w2_groups: torch.Tensor | None = None,    # [E, I] int32 (act order)
) -> torch.Tensor:            # [E, M, H] in x.dtype, rows past counts[e] zero
    """masked_expert_mlp with int4 weights; stale rows past counts[e] are never read (they may hold NaN)."""
    check_int4_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups)
    max_count = check_masked_counts(x, counts, w13.shape[0])
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    if padded_layout_wins(counts, max_count):
        masked_through_padded(out, x, counts, max_count, lambda padded: int4_swiglu_padded(
            padded, w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups))
        return out
    for seg in masked_segments(counts):
        e = seg.expert
        out[e, :seg.end] = int4_swiglu(x[e, :seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e], layout,
                                       None if w13_groups is None else w13_groups[e],
                                       None if w2_groups is None else w2_groups[e])
    return out
