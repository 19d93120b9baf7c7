"""Weighted sum of each token's K expert outputs, read through a (token, k) -> row map."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..permute import PermutePlan


@triton.jit
def unpermute_reduce_kernel(src_ptr, row_of_pair_ptr, weights_ptr, out_ptr, H, stride_src, stride_out,
                            TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(row_of_pair_ptr + token * TOP_K + k)                # -1: pair was dropped
        weight = tl.load(weights_ptr + token * TOP_K + k).to(tl.float32)
        row_ok = (cols * 0 + row) >= 0                                   # broadcast: scalar masks trip the interpreter
        values = tl.load(src_ptr + row * stride_src + cols, mask=col_ok & row_ok, other=0.0)
        acc += weight * values.to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def reduce_pairs(src: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """y[t] = sum_k weights[t, k] * src[row_of_pair[t*K + k]] (rows < 0 add nothing)."""
    top_k, hidden = weights.shape[1], src.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=src.dtype, device=src.device)  # [T, H]
    if num_tokens == 0 or hidden == 0:
        return out
    if top_k == 0:
        return out.zero_()
    block_h = min(1024, triton.next_power_of_2(hidden))
    unpermute_reduce_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        src, row_of_pair.contiguous(), weights.float().contiguous(), out, hidden, src.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h,
    )
    return out


def unpermute_reduce(out_sorted: torch.Tensor, plan: PermutePlan, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if out_sorted.shape[0] != plan.num_rows:
        raise ValueError(f"out_sorted has {out_sorted.shape[0]} rows but the plan has {plan.num_rows}")
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"weights must be [T={num_tokens}, K], got shape {tuple(weights.shape)}")
    row_of_pair = torch.full((weights.numel(),), -1, dtype=torch.int64, device=out_sorted.device)  # [T*K]
    row_of_pair[plan.flat_index] = torch.arange(plan.num_rows, device=out_sorted.device)
    return reduce_pairs(out_sorted.contiguous(), row_of_pair, weights, num_tokens)
