"""Varlen prefill attention over a paged KV cache in one launch: every new query row of every sequence of a
step, each attending causally to its sequence's cached context and to itself (flash attention, cu_seqlens).

Grid (sequence, query tile, head block). A program holds BLOCK_M query rows x BLOCK_H query heads of one
KV head as one [BLOCK_M * BLOCK_H, D] tile (GQA: the heads of a group share each K/V tile it loads) and
runs the online softmax over the sequence's keys [0, last query position], BLOCK_N keys at a time,
each key's address gathered through the block table (any block size). Query i of a sequence with n new
tokens and context c sits at position c - n + i: chunked prefill and prefix-cache hits are the c > n case.

Head dims that are not a power of two are split in two tiles (DeepSeek's absorbed MLA: 576 = 512 latent
+ 64 rope; 192 = 128 + 64), so no tile is padded to the next power of two. MLA runs here in its absorbed
form (MQA over the latent cache, values a prefix view of the keys), as FlashInfer's MLA kernel does.

Spans (`SPAN`: 0 full, 1 sliding window, 2 chunk of `span_size`): row i reads keys [first(i), i], first(i) =
max(i - W + 1, 0) or i // C * C; a tile starts at its first row's first key, and keys before it are never
loaded (they may lie in a windowed KV cache group's freed blocks, the scratch block). Sinks (gpt-oss): each
row's online softmax starts with its head's sink logit as a key of value zero (running max = sink, sum = 1).

The torch twin is `kernels.paged_prefill_attention.paged_prefill_attention`. Not yet run compiled on a GPU
(only in the interpreter): the tile sizes in `prefill_tiles` are first guesses for sm90.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..key_span import KeySpan, span_constants
from ..paged_prefill_attention import PagedPrefillBatch, check_prefill_inputs
from .head_dim_split import HeadDimSplit, head_dim_split
from .interpreter import running_in_interpreter
from .online_softmax import online_softmax_step


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, cu_q_ptr, lens_ptr, sinks_ptr, out_ptr, scale, span_size,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_MAIN: tl.constexpr, D_MAIN_PAD: tl.constexpr, D_TAIL: tl.constexpr, D_TAIL_PAD: tl.constexpr, V_DIM: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPAN: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv_head = (tl.program_id(2) // HEAD_BLOCKS).to(tl.int64)
    first_in_group = (tl.program_id(2) % HEAD_BLOCKS) * BLOCK_H
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1) - tl.load(cu_q_ptr + seq)
    if tile * BLOCK_M < q_len:
        context = tl.load(lens_ptr + seq)
        first_pos = context - q_len                                        # position of the sequence's first new row
        rows = tl.arange(0, BLOCK_M * BLOCK_H)
        query = tile * BLOCK_M + rows // BLOCK_H                           # [R] new-token index in the sequence
        in_group = first_in_group + rows % BLOCK_H
        row_ok = (query < q_len) & (in_group < GROUP)
        head = kv_head * GROUP + in_group                                  # [R] query head
        query_pos = first_pos + query                                      # [R]
        q_rows = q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh
        main = tl.arange(0, D_MAIN_PAD)
        q_main = tl.load(q_rows + main[None, :], mask=row_ok[:, None] & (main[None, :] < D_MAIN), other=0.0)                 # [R, Dm]
        if D_TAIL_PAD > 0:
            tail = tl.arange(0, D_TAIL_PAD)
            q_tail = tl.load(q_rows + D_MAIN + tail[None, :], mask=row_ok[:, None] & (tail[None, :] < D_TAIL),
                             other=0.0)                                                           # [R, Dt]
        v_dims = tl.arange(0, DV_PAD)
        keys_idx = tl.arange(0, BLOCK_N)
        running_max = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        if HAS_SINKS:   # the sink: a key of logit sinks[head] and value zero, in every row's softmax
            running_max = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            running_sum = tl.full([BLOCK_M * BLOCK_H], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, DV_PAD], dtype=tl.float32)
        kv_end = first_pos + tl.minimum((tile + 1) * BLOCK_M, q_len)      # one past the tile's last query
        tile_pos = first_pos + tile * BLOCK_M                              # the tile's first query position
        row_first = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.int32)          # [R] each row's first key
        tile_first = 0                                                     # the tile's first row's (the least)
        if SPAN == 1:
            row_first = tl.maximum(query_pos - span_size + 1, 0)
            tile_first = tl.maximum(tile_pos - span_size + 1, 0)
        if SPAN == 2:
            row_first = query_pos // span_size * span_size
            tile_first = tile_pos // span_size * span_size
        for block_start in range(tile_first // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
            key_pos = block_start + keys_idx                               # [N]
            key_ok = (key_pos < kv_end) & (key_pos >= tile_first)          # never load a key no row reads
            page = tl.load(tables_ptr + seq * stride_tb + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot = (key_pos % BLOCK_SIZE).to(tl.int64)
            k_rows = k_ptr + page * stride_kb + slot * stride_ks + kv_head * stride_kh                    # [N]
            k_main = tl.load(k_rows[None, :] + main[:, None], mask=key_ok[None, :] & (main[:, None] < D_MAIN),
                             other=0.0)                                                                  # [Dm, N]
            scores = tl.dot(q_main, k_main, input_precision=PRECISION)                                  # [R, N]
            if D_TAIL_PAD > 0:
                k_tail = tl.load(k_rows[None, :] + D_MAIN + tail[:, None],
                                 mask=key_ok[None, :] & (tail[:, None] < D_TAIL), other=0.0)             # [Dt, N]
                scores += tl.dot(q_tail, k_tail, input_precision=PRECISION)
            allowed = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
            if SPAN != 0:
                allowed = allowed & (key_pos[None, :] >= row_first[:, None])
            scores = tl.where(allowed, scores * scale, float("-inf"))
            probs, correction, new_max, running_sum = online_softmax_step(scores, running_max, running_sum)  # [R, N]
            v_rows = v_ptr + page * stride_vb + slot * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + v_dims[None, :], mask=key_ok[:, None] & (v_dims[None, :] < V_DIM),
                        other=0.0)                                                                       # [N, Dv]
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        out_rows = out_ptr + (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_rows + v_dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (v_dims[None, :] < V_DIM))


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int     # query rows per program
    block_h: int     # query heads per program (of one KV head)
    block_n: int     # keys per inner step
    num_warps: int


def prefill_tiles(group: int, split: HeadDimSplit, v_dim: int, max_query_len: int) -> PrefillTiles:
    """About 64 query rows x heads per program (32 for MLA's 512-wide values, whose fp32 accumulator would
    not fit in registers), at least 16 of each for tl.dot; small tiles in the interpreter, where time goes
    with the padded work."""
    if running_in_interpreter():
        block_h = min(triton.next_power_of_2(group), 16)
        block_m = max(1, 16 // block_h)
        return PrefillTiles(block_m, block_h, 16, 4)
    rows = 32 if max(split.padded, triton.next_power_of_2(v_dim)) > 256 else 64
    block_h = min(triton.next_power_of_2(group), rows)
    block_m = max(1, rows // block_h)
    block_m = min(block_m, max(16 // block_h, triton.next_power_of_2(max(max_query_len, 1))))
    block_n = 32 if split.padded > 256 else 64
    return PrefillTiles(block_m, block_h, block_n, 8 if rows * triton.next_power_of_2(v_dim) >= 32 * 512 else 4)


def paged_prefill_attention(q, k_cache, v_cache, batch: PagedPrefillBatch, scale: float,
                            span: KeySpan | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq, Dv]. `span`: None = full attention; `sinks` [Hq] fp32 logits or None."""
    check_prefill_inputs(q, k_cache, v_cache, batch)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq={q.shape[1]}], got {tuple(sinks.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[2], v_cache.shape[3]
    out = torch.empty(num_tokens, num_q_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    q = q if q.stride(2) == 1 else q.contiguous()
    group = num_q_heads // num_kv_heads
    split = head_dim_split(head_dim)
    tiles = prefill_tiles(group, split, v_dim, batch.max_query_len)
    head_blocks = triton.cdiv(group, tiles.block_h)
    span_code, span_size = span_constants(span)
    grid = (batch.num_seqs, triton.cdiv(batch.max_query_len, tiles.block_m), num_kv_heads * head_blocks)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
        out if sinks is None else sinks.float().contiguous(), out, float(scale), span_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), batch.block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_SIZE=k_cache.shape[1],
        D_MAIN=split.main, D_MAIN_PAD=split.main_padded, D_TAIL=split.tail, D_TAIL_PAD=split.tail_padded, V_DIM=v_dim,
        DV_PAD=max(16, triton.next_power_of_2(v_dim)), BLOCK_M=tiles.block_m, BLOCK_H=tiles.block_h,
        BLOCK_N=tiles.block_n, SPAN=span_code, HAS_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tiles.num_warps,
    )
    return out
