"""The lightning indexer's scores in Triton: one program per (query row, tile of BLOCK_S keys) computes the row's
heads against the tile with one dot ([H, D] x [D, S]), applies ReLU and sums the heads by their weights. Keys shared
by every row have row stride 0. The torch twin and reference: moe_runtime/kernels/index_scores.py. Not yet run compiled on a
GPU: only in the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..index_scores import check_index_inputs
from .interpreter import running_in_interpreter


@triton.jit
def index_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, scale, num_keys,
    stride_qn, stride_qh, stride_wn, stride_kn, stride_ks, stride_on,
    HEADS: tl.constexpr, DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    keys_idx = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < HEADS
    dim_ok = dims < DIM
    key_ok = keys_idx < num_keys
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)                   # [H, D]
    weights = tl.load(w_ptr + row * stride_wn + heads, mask=head_ok, other=0.0).to(tl.float32)      # [H]
    k = tl.load(k_ptr + row * stride_kn + keys_idx[:, None] * stride_ks + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)                   # [S, D]
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                             # [H, S]
    total = tl.sum(weights[:, None] * tl.maximum(scores, 0.0), axis=0)                              # [S]
    tl.store(out_ptr + row * stride_on + keys_idx, total, mask=key_ok)


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """queries [n, H, D], weights [n, H] fp32, keys [S, D] or [n, S, D] -> scores [n, S] fp32."""
    check_index_inputs(queries, weights, keys)
    rows, heads, dim = queries.shape
    num_keys = keys.shape[-2]
    out = torch.empty(rows, num_keys, dtype=torch.float32, device=queries.device)
    if rows == 0 or num_keys == 0:
        return out
    queries = queries if queries.stride(2) == 1 else queries.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.float()
    block_s = 16 if running_in_interpreter() else 64
    index_scores_kernel[(rows, triton.cdiv(num_keys, block_s))](
        queries, weights, keys, out, float(scale), num_keys,
        queries.stride(0), queries.stride(1), weights.stride(0), keys.stride(0) if keys.dim() == 3 else 0,
        keys.stride(-2), out.stride(0),
        HEADS=heads, DIM=dim, H_PAD=max(16, triton.next_power_of_2(heads)), D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_S=block_s, PRECISION="ieee",
    )
    return out
