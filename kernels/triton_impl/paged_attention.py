"""Decode attention over a paged KV cache: one program per (sequence, KV head), all its query heads.

Online softmax over the sequence's cache blocks; GQA/MQA query heads sharing a KV head are
processed together so each K/V block is read once. MLA-style caches (V a prefix view of K) work
through strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged_attention import check_paged_inputs


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    length = tl.load(lens_ptr + seq)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)                     # query heads of this KV head
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims, v_dims, slots = tl.arange(0, D_PAD), tl.arange(0, DV_PAD), tl.arange(0, S_PAD)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0).to(tl.float32)  # [G, D]
    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DV_PAD], dtype=tl.float32)
    for block in range(0, tl.cdiv(length, BLOCK_SIZE)):
        physical = tl.load(tables_ptr + seq * stride_tb + block).to(tl.int64)
        positions = block * BLOCK_SIZE + slots
        live = (slots < BLOCK_SIZE) & (positions < length)
        k = tl.load(k_ptr + physical * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=live[:, None] & (dims[None, :] < HEAD_DIM), other=0.0).to(tl.float32)      # [S, D]
        v = tl.load(v_ptr + physical * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + v_dims[None, :],
                    mask=live[:, None] & (v_dims[None, :] < V_DIM), other=0.0).to(tl.float32)     # [S, Dv]
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)       # [G, S]
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])                         # [G, S]
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if USE_DOT:
            acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]     # empty context -> zeros
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + v_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (v_dims[None, :] < V_DIM))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads, v_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    out = torch.empty(batch, num_q_heads, v_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim")
    q = q if q.stride(2) == 1 else q.contiguous()
    group = num_q_heads // num_kv_heads
    group_pad, s_pad = max(triton.next_power_of_2(group), 1), triton.next_power_of_2(block_size)
    paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_SIZE=block_size,
        GROUP_PAD=group_pad, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        DV_PAD=max(16, triton.next_power_of_2(v_dim)), S_PAD=max(16, s_pad) if group_pad >= 16 else s_pad,
        USE_DOT=group_pad >= 16,
    )
    return out
