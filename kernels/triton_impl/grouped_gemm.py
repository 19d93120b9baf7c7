"""Grouped GEMM over a BlockSchedule: every BLOCK_M tile multiplies rows of one expert.

One kernel serves both expert projections: with SWIGLU it computes silu(x @ gate.T) * (x @ up.T)
from w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) in one pass; without it, x @ w2[e].T.
Row gathering (tokens -> tiles) and scattering (tiles -> rows) are folded into the loads/stores.

With FP8_WEIGHTS the weights stay float8_e4m3fn in memory (the runtime's FP8 layout: row-expanded
block scales [E, N, ceil(K / block_k)], see kernels/fp8_block_weights.py): each weight tile is
loaded as FP8 (or as its bytes, see fp8_e4m3.py), converted to fp32, multiplied by the scale of its
k-block, cast to the activations' dtype and fed to tl.dot. BLOCK_K is chosen to divide block_k so a
tile needs one scale per weight row; where no power of two >= 16 divides block_k, each element
looks up its own block's scale (SCALE_PER_ELEMENT).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..expert_mlp import check_expert_weights, check_masked_counts, check_sorted_counts
from .align import BlockSchedule, schedule_from_counts
from .fp8_e4m3 import fp8_tile_to_float

MIN_DOT_K = 16        # tl.dot's smallest K
MAX_BLOCK_K = 64


@dataclass(frozen=True)
class BlockScales:
    """Row-expanded block scales of an FP8 weight operand.

    scale[e, n, j] multiplies w[e, n, j*block_k : (j+1)*block_k].
    """

    scale: torch.Tensor   # [E, N, ceil(K / block_k)] float32
    block_k: int


@triton.jit
def load_weight_tile(w_base, s_base, rows, ks, k0, row_ok, k_ok, stride_wn, stride_wk, stride_sn, stride_sk,
                     scale_block_k, FP8_WEIGHTS: tl.constexpr, E4M3_BYTES: tl.constexpr,
                     SCALE_PER_ELEMENT: tl.constexpr):
    """The [BK, BN] tile w[rows, ks].T: as stored, or with FP8_WEIGHTS dequantized to fp32 with its block scales."""
    mask = k_ok[:, None] & row_ok[None, :]
    w = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] * stride_wk, mask=mask, other=0.0)
    if FP8_WEIGHTS:
        if SCALE_PER_ELEMENT:
            scale = tl.load(s_base + rows[None, :] * stride_sn + (ks[:, None] // scale_block_k) * stride_sk,
                            mask=mask, other=0.0)                             # [BK, BN]
        else:
            scale = tl.load(s_base + rows * stride_sn + (k0 // scale_block_k) * stride_sk,
                            mask=row_ok, other=0.0)[None, :]                  # [1, BN]: one k-block per tile
        w = fp8_tile_to_float(w, E4M3_BYTES) * scale
    return w


@triton.jit
def grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, padded_rows_ptr, block_expert_ptr, scale_ptr,
    N, K, up_offset, a_row_divisor, scale_block_k,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_sn, stride_sk,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
    FP8_WEIGHTS: tl.constexpr, E4M3_BYTES: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)                        # padded slots of this tile
    rows = tl.load(padded_rows_ptr + slots)                               # [BM] int64, -1 = padding
    valid = rows >= 0
    if GATHER_A:
        a_rows = tl.where(valid, rows // a_row_divisor, 0)
    else:
        a_rows = slots.to(tl.int64)
    if SCATTER_OUT:
        out_rows = tl.where(valid, rows, 0)
    else:
        out_rows = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    s_base = scale_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)       # [BM, BK]
        w = load_weight_tile(w_base, s_base, cols, ks, k0, col_ok, k_ok, stride_wn, stride_wk, stride_sn, stride_sk,
                             scale_block_k, FP8_WEIGHTS, E4M3_BYTES, SCALE_PER_ELEMENT)      # [BK, BN]
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        if SWIGLU:
            w_up = load_weight_tile(w_base, s_base, cols + up_offset, ks, k0, col_ok, k_ok, stride_wn, stride_wk,
                                    stride_sn, stride_sk, scale_block_k, FP8_WEIGHTS, E4M3_BYTES, SCALE_PER_ELEMENT)
            acc_up += tl.dot(a, w_up.to(a.dtype), input_precision=PRECISION)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def pick_block_m(num_rows: int, num_experts: int) -> int:
    return 16 if num_rows <= 32 * max(num_experts, 1) else 64


def pick_block_k(k_dim: int, scales: BlockScales | None) -> int:
    """BLOCK_K: up to MAX_BLOCK_K; with FP8 weights also a divisor of block_k where a power of two >= 16 is."""
    block_k = min(MAX_BLOCK_K, max(MIN_DOT_K, triton.next_power_of_2(k_dim)))
    if scales is not None:
        divisor = scales.block_k & -scales.block_k                        # largest power of two dividing it
        if divisor >= MIN_DOT_K:
            block_k = min(block_k, divisor)
    return block_k


def run_grouped_gemm(a, w, out, schedule: BlockSchedule, *, swiglu: bool, gather_a: bool, scatter_out: bool,
                     a_row_divisor: int = 1, scales: BlockScales | None = None) -> None:
    """out[rows] = (swiglu of) a[rows] @ w[expert].T for every tile of the schedule.

    With `scales`, w is an FP8 weight: float8_e4m3fn, or its uint8 view for the bytes path (fp8_e4m3.py).
    """
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    k_dim = w.shape[2]
    if schedule.num_blocks == 0 or n_out == 0:
        return
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = pick_block_k(k_dim, scales)
    scale = w if scales is None else scales.scale                         # unread without FP8_WEIGHTS
    scale_block_k = 1 if scales is None else scales.block_k
    grid = (schedule.num_blocks, triton.cdiv(n_out, block_n))
    grouped_gemm_kernel[grid](
        a, w, out, schedule.padded_rows, schedule.block_expert, scale,
        n_out, k_dim, n_out, a_row_divisor, scale_block_k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        *(scale.stride() if scales is not None else (0, 0, 0)),
        GATHER_A=gather_a, SCATTER_OUT=scatter_out, SWIGLU=swiglu,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8_WEIGHTS=scales is not None, E4M3_BYTES=w.dtype == torch.uint8,
        SCALE_PER_ELEMENT=scales is not None and scale_block_k % block_k != 0,
        BLOCK_M=schedule.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def swiglu_then_down(a, schedule: BlockSchedule, w13, w2, out, *, gather_a: bool, scatter_out: bool,
                     a_row_divisor: int = 1, w13_scales: BlockScales | None = None,
                     w2_scales: BlockScales | None = None) -> None:
    """Both expert projections over one schedule; the [P, I] activation lives in padded-slot order."""
    intermediate = w13.shape[1] // 2
    activation = torch.empty(schedule.padded_rows.shape[0], intermediate, dtype=a.dtype, device=a.device)
    run_grouped_gemm(a, w13, activation, schedule, swiglu=True, gather_a=gather_a, scatter_out=False,
                     a_row_divisor=a_row_divisor, scales=w13_scales)
    run_grouped_gemm(activation, w2, out, schedule, swiglu=False, gather_a=False, scatter_out=scatter_out,
                     scales=w2_scales)


def sorted_experts(x_sorted, counts, w13, w2, *, w13_scales: BlockScales | None = None,
                   w2_scales: BlockScales | None = None) -> torch.Tensor:
    """The contiguous layout's expert MLP once validated: [N, H] rows grouped by expert -> [N, H]."""
    num_rows = x_sorted.shape[0]
    out = torch.empty(num_rows, w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    row_start = torch.cumsum(counts, dim=0) - counts                       # [E]
    schedule = schedule_from_counts(counts, row_start, num_rows, pick_block_m(num_rows, w13.shape[0]))
    swiglu_then_down(x_sorted, schedule, w13, w2, out, gather_a=True, scatter_out=True,
                     w13_scales=w13_scales, w2_scales=w2_scales)
    return out


def masked_experts(x, counts, w13, w2, *, w13_scales: BlockScales | None = None,
                   w2_scales: BlockScales | None = None) -> torch.Tensor:
    """The masked layout's expert MLP once validated: [E, M, H] -> [E, M, H], rows past counts[e] zero."""
    num_experts, capacity, hidden = x.shape
    out = torch.zeros(num_experts * capacity, w2.shape[1], dtype=x.dtype, device=x.device)  # [E*M, H]
    row_start = torch.arange(num_experts, device=x.device) * capacity
    schedule = schedule_from_counts(counts, row_start, num_experts * capacity,
                                    pick_block_m(int(capacity), 1))
    swiglu_then_down(x.reshape(num_experts * capacity, hidden), schedule, w13, w2, out,
                     gather_a=True, scatter_out=True, w13_scales=w13_scales, w2_scales=w2_scales)
    return out.view(num_experts, capacity, w2.shape[1])


def expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return sorted_experts(x_sorted, counts, w13, w2)


def masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    check_expert_weights(x.shape[-1], w13, w2)
    check_masked_counts(x, counts, w13.shape[0])
    return masked_experts(x, counts, w13, w2)
