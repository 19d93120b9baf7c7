"""DeepSeek Sparse Attention's MLA over chosen cache entries: one program per (query row, head block) walks the
row's chosen slots in tiles of BLOCK_N, gathering each entry by its flat slot, with the online softmax of the paged
kernels. The entry is the key ([latent | rotated key], tiled as `head_dim_split` cuts it: 576 = 512 + 64) and its
first `value_dim` channels the value. Slots -1 (a row's choice padded to the step's widest) are masked; a row
with none gets zeros. The torch twin and reference: moe_runtime/kernels/sparse_latent_attention.py. Not yet run compiled on a
GPU: only in the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sparse_latent_attention import check_sparse_inputs
from .head_dim_split import head_dim_split
from .key_tile import channel_scores, fold_values
from .online_softmax import online_softmax_step
from .paged_attention import decode_tiles


@triton.jit
def sparse_latent_attention_kernel(
    q_ptr, entries_ptr, slots_ptr, out_ptr, scale, width,
    stride_qt, stride_qh, stride_en, stride_st, stride_ot, stride_oh,
    HEADS: tl.constexpr, D_MAIN: tl.constexpr, D_MAIN_PAD: tl.constexpr, D_TAIL: tl.constexpr,
    D_TAIL_PAD: tl.constexpr, V_DIM: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    q_rows = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    main = tl.arange(0, D_MAIN_PAD)
    q_main = tl.load(q_rows + main[None, :], mask=head_ok[:, None] & (main[None, :] < D_MAIN), other=0.0)  # [H, Dm]
    if D_TAIL_PAD > 0:
        tail = tl.arange(0, D_TAIL_PAD)
        q_tail = tl.load(q_rows + D_MAIN + tail[None, :], mask=head_ok[:, None] & (tail[None, :] < D_TAIL),
                         other=0.0)                                                                      # [H, Dt]
    v_dims = tl.arange(0, DV_PAD)
    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
    for tile_start in range(0, width, BLOCK_N):
        index = tile_start + tl.arange(0, BLOCK_N)                                                      # [N]
        slot = tl.load(slots_ptr + row * stride_st + index, mask=index < width, other=-1)
        key_ok = slot >= 0
        e_rows = entries_ptr + tl.where(key_ok, slot, 0).to(tl.int64) * stride_en                       # [N]
        scores = channel_scores(q_main, e_rows, key_ok, main, 0, D_MAIN, USE_DOT, PRECISION)             # [H, N]
        if D_TAIL_PAD > 0:
            scores += channel_scores(q_tail, e_rows, key_ok, tail, D_MAIN, D_TAIL, USE_DOT, PRECISION)
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        probs, correction, new_max, running_sum = online_softmax_step(scores, running_max, running_sum)  # [H, N]
        acc = fold_values(acc, probs, correction, e_rows, key_ok, v_dims, V_DIM, USE_DOT, PRECISION)
        running_max = new_max
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]                                    # [H, Dv]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + v_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (v_dims[None, :] < V_DIM))


def sparse_latent_attention(q: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, scale: float,
                            value_dim: int) -> torch.Tensor:
    """q [T, H, D], entries [N, D], slots [T, K] int64 (-1: none) -> [T, H, value_dim]."""
    check_sparse_inputs(q, entries, slots, value_dim)
    rows, heads, dim = q.shape
    out = torch.zeros(rows, heads, value_dim, dtype=q.dtype, device=q.device)
    if rows == 0 or slots.shape[1] == 0:
        return out
    if entries.stride(1) != 1:
        raise ValueError("entries must be contiguous in their last dim")
    q = q if q.stride(2) == 1 else q.contiguous()
    slots = slots.contiguous()
    split = head_dim_split(dim)
    block_h, block_n = decode_tiles(heads, split.padded, value_dim)
    dv_pad = max(16, triton.next_power_of_2(value_dim))
    sparse_latent_attention_kernel[(rows, triton.cdiv(heads, block_h))](
        q, entries, slots, out, float(scale), slots.shape[1],
        q.stride(0), q.stride(1), entries.stride(0), slots.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, D_MAIN=split.main, D_MAIN_PAD=split.main_padded, D_TAIL=split.tail,
        D_TAIL_PAD=split.tail_padded, V_DIM=value_dim, DV_PAD=dv_pad, BLOCK_H=block_h, BLOCK_N=block_n,
        USE_DOT=block_h >= 16, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if dv_pad >= 512 else 4,
    )
    return out
