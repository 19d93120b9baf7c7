"""Per-token-group FP8 quantization of a GEMM's activations, in Triton (the FP8-activation scheme).

Each row is cut into groups of 128 columns (the last may be partial); a group's scale is
max(amax, 1e-4) / 448 and its entries are x * (448 / amax) clamped to +-448 and rounded to the
nearest e4m3fn value: moe_runtime/dispatch/fp8_activations.py's `quantize_token_groups`, bit for bit (the tests
compare the two), which is what DeepEP's FP8 dispatch produces. Divisions are correctly rounded
(`tl.div_rn`) so the compiled kernel agrees with torch too.

Which rows are quantized (the others are left unwritten: their values and scales are undefined, and
the GEMM never loads them):
- dense: rows 0 .. R-1, all of them;
- slots: the padded slots of a BlockSchedule that hold a row (padded_rows >= 0), so a GEMM's
  intermediate in slot order is quantized without its padding's garbage;
- masked ([E * M, K], DeepEP low-latency): expert e's rows e*M .. e*M + counts[e] - 1, counts read on
  the device. Programs past a count exit, so the stale rows of a dispatch buffer cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_e4m3 import float_to_e4m3_bits
from .fp8_scheme import ACTIVATION_GROUP, Fp8Scheme

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4        # DeepEP's kFP8Margin (moe_runtime/dispatch/fp8_activations.py)
BLOCK_ROWS = 16


@dataclass(frozen=True)
class QuantizedActivations:
    """Entry [r, j] is values[r, j] * scales[r, j // 128]."""

    values: torch.Tensor   # [R, K] float8_e4m3fn (native dot) or its uint8 codes (emulated dot)
    scales: torch.Tensor   # [R, ceil(K / 128)] float32


@triton.jit
def quantize_groups_kernel(
    x_ptr, values_ptr, scales_ptr, counts_ptr, padded_rows_ptr, K, capacity, stride_xr, stride_xk,
    MASKED: tl.constexpr, SLOTS: tl.constexpr, NATIVE_FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    expert = tl.program_id(0)
    local = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)            # rows of this expert (dense: of all)
    if MASKED:
        count = tl.minimum(tl.maximum(tl.load(counts_ptr + expert).to(tl.int64), 0), capacity)
    else:
        count = capacity
    if tl.program_id(1) * BLOCK_R >= count:
        return
    valid = local < count
    rows = tl.where(valid, expert.to(tl.int64) * capacity + local, 0)    # [BR]
    if SLOTS:
        valid = valid & (tl.load(padded_rows_ptr + rows, mask=valid, other=-1) >= 0)
    group = tl.program_id(2)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = valid[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)                                                  # [BR, GROUP]
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)              # [BR]
    scaled = x * tl.div_rn(tl.full(amax.shape, E4M3_MAX, tl.float32), amax)[:, None]
    scaled = tl.minimum(tl.maximum(scaled, -E4M3_MAX), E4M3_MAX)
    if NATIVE_FP8:
        codes = scaled.to(values_ptr.dtype.element_ty)                    # cvt.rn.satfinite on sm89+
    else:
        codes = float_to_e4m3_bits(scaled)
    tl.store(values_ptr + rows[:, None] * K + cols[None, :], codes, mask=mask)
    num_groups = tl.cdiv(K, GROUP)
    tl.store(scales_ptr + rows * num_groups + group, tl.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32)),
             mask=valid)


def quantize_activations(x: torch.Tensor, scheme: Fp8Scheme, counts: torch.Tensor | None = None,
                         capacity: int | None = None,
                         padded_rows: torch.Tensor | None = None) -> QuantizedActivations:
    """x [R, K] (any strides) -> codes and scales; with `counts` [E] the masked layout (R = E * capacity),
    with `padded_rows` [R] only the slots holding a row."""
    num_rows, k_dim = x.shape
    groups = triton.cdiv(k_dim, ACTIVATION_GROUP)
    values = torch.empty(num_rows, k_dim, dtype=scheme.activation_dtype(), device=x.device)  # [R, K]
    scales = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)             # [R, G]
    masked = counts is not None
    experts, rows_each = (counts.shape[0], capacity) if masked else (1, num_rows)
    if num_rows and k_dim and experts:
        quantize_groups_kernel[(experts, triton.cdiv(rows_each, BLOCK_ROWS), groups)](
            x, values, scales, counts if masked else x, x if padded_rows is None else padded_rows,
            k_dim, rows_each, x.stride(0), x.stride(1),
            MASKED=masked, SLOTS=padded_rows is not None, NATIVE_FP8=scheme.native_dot, GROUP=ACTIVATION_GROUP, BLOCK_R=BLOCK_ROWS,
        )
    return QuantizedActivations(values, scales)
