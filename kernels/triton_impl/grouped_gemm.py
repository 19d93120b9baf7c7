"""Grouped GEMM over a BlockSchedule: every BLOCK_M tile multiplies rows of one expert.

One kernel serves both expert projections: with SWIGLU it computes silu(x @ gate.T) * (x @ up.T)
from w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) in one pass; without it, x @ w2[e].T.
Row gathering (tokens -> tiles) and scattering (tiles -> rows) are folded into the loads/stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..expert_mlp import check_expert_weights
from .align import BlockSchedule, schedule_from_counts


@triton.jit
def grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, padded_rows_ptr, block_expert_ptr,
    N, K, up_offset, a_row_divisor,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)       # [BM, BK]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BK, BN]
        acc += tl.dot(a, w, input_precision=PRECISION)
        if SWIGLU:
            w_up = tl.load(w_base + (cols[None, :] + up_offset) * stride_wn + ks[:, None] * stride_wk,
                           mask=w_mask, other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def pick_block_m(num_rows: int, num_experts: int) -> int:
    return 16 if num_rows <= 32 * max(num_experts, 1) else 64


def run_grouped_gemm(a, w, out, schedule: BlockSchedule, *, swiglu: bool, gather_a: bool, scatter_out: bool,
                     a_row_divisor: int = 1) -> None:
    """out[rows] = (swiglu of) a[rows] @ w[expert].T for every tile of the schedule."""
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    k_dim = w.shape[2]
    if schedule.num_blocks == 0 or n_out == 0:
        return
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_dim)))
    grid = (schedule.num_blocks, triton.cdiv(n_out, block_n))
    grouped_gemm_kernel[grid](
        a, w, out, schedule.padded_rows, schedule.block_expert,
        n_out, k_dim, n_out, a_row_divisor,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        GATHER_A=gather_a, SCATTER_OUT=scatter_out, SWIGLU=swiglu,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=schedule.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def swiglu_then_down(a, schedule: BlockSchedule, w13, w2, out, *, gather_a: bool, scatter_out: bool,
                     a_row_divisor: int = 1) -> None:
    """Both expert projections over one schedule; the [P, I] activation lives in padded-slot order."""
    intermediate = w13.shape[1] // 2
    activation = torch.empty(schedule.padded_rows.shape[0], intermediate, dtype=a.dtype, device=a.device)
    run_grouped_gemm(a, w13, activation, schedule, swiglu=True, gather_a=gather_a, scatter_out=False,
                     a_row_divisor=a_row_divisor)
    run_grouped_gemm(activation, w2, out, schedule, swiglu=False, gather_a=False, scatter_out=scatter_out)


def expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    if counts.shape != (w13.shape[0],):
        raise ValueError(f"counts must be [E={w13.shape[0]}], got shape {tuple(counts.shape)}")
    num_rows = x_sorted.shape[0]
    if int(counts.sum()) != num_rows:
        raise ValueError(f"counts sum to {int(counts.sum())} but x_sorted has {num_rows} rows")
    out = torch.empty(num_rows, w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    row_start = torch.cumsum(counts, dim=0) - counts                       # [E]
    schedule = schedule_from_counts(counts, row_start, num_rows, pick_block_m(num_rows, w13.shape[0]))
    swiglu_then_down(x_sorted, schedule, w13, w2, out, gather_a=True, scatter_out=True)
    return out


def masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    check_expert_weights(x.shape[-1], w13, w2)
    if x.dim() != 3 or x.shape[0] != w13.shape[0]:
        raise ValueError(f"x must be [E={w13.shape[0]}, M, H], got shape {tuple(x.shape)}")
    num_experts, capacity, hidden = x.shape
    if bool((counts > capacity).any()):
        raise ValueError(f"counts {counts.tolist()} exceed the masked layout's capacity M={capacity}")
    out = torch.zeros(num_experts * capacity, w2.shape[1], dtype=x.dtype, device=x.device)  # [E*M, H]
    row_start = torch.arange(num_experts, device=x.device) * capacity
    schedule = schedule_from_counts(counts, row_start, num_experts * capacity,
                                    pick_block_m(int(capacity), 1))
    swiglu_then_down(x.reshape(num_experts * capacity, hidden), schedule, w13, w2, out,
                     gather_a=True, scatter_out=True)
    return out.view(num_experts, capacity, w2.shape[1])
