"""Decode attention over a paged KV cache, split over the context (flash-decoding).

One query row per sequence leaves few programs when each runs a whole (sequence, KV head): DeepSeek's
MLA is one KV head, so at batch 1 one program would walk the whole context while the GPU's other SMs
idle. Stage 1 gives each (sequence, head block, split) its own program: split s of a sequence of
length L covers keys [s * chunk, (s + 1) * chunk), chunk = ceil(ceil(L / splits) / BLOCK_N) * BLOCK_N,
read from the device (no host read of context lengths: the launch stays CUDA-graph capturable), and
writes its normalised partial output and log-sum-exp. Stage 2 merges a sequence's splits by their
log-sum-exp (the merge of `moe_runtime/kernels/prefix_causal_attention.py`). With one split, stage 1 writes the
output itself and stage 2 does not run.

The split count comes from static things only (batch, heads, the block table's width): enough programs
to fill the device twice (`DecodeSplitPolicy`), never more splits than BLOCK_N-key chunks a full table
holds. GQA query heads sharing a KV head run in one program (each K/V tile read once for all); MLA
caches (values a prefix view of the keys) work through strides; head dims are tiled as in
`head_dim_split.py` (576 = 512 + 64). Not yet run compiled on a GPU: only in the Triton interpreter.

Windows and chunks: `key_starts` [B] gives each row's first key (the caller computes it: no host read here),
and the splits cover [key_start, length) only; keys before it are never loaded (a windowed KV cache group's
freed blocks point at a scratch block holding anything). Sinks (gpt-oss): split 0 starts its online softmax
with the head's sink logit as a key of value zero (running max = sink, running sum = 1), so the merge of the
splits by their log-sum-exps puts it in every row's denominator exactly once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..paged_attention import check_paged_inputs
from .head_dim_split import head_dim_split
from .interpreter import running_in_interpreter
from .key_tile import channel_scores, fold_values
from .online_softmax import online_softmax_step


@triton.jit
def paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, starts_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale,
    num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_MAIN: tl.constexpr, D_MAIN_PAD: tl.constexpr, D_TAIL: tl.constexpr, D_TAIL_PAD: tl.constexpr,
    V_DIM: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, HAS_STARTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = (tl.program_id(1) // HEAD_BLOCKS).to(tl.int64)
    in_group = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = in_group < GROUP
    heads = kv_head * GROUP + in_group                                     # [H] query heads
    length = tl.load(lens_ptr + seq)
    first = 0
    if HAS_STARTS:
        first = tl.minimum(tl.maximum(tl.load(starts_ptr + seq), 0), length)
    chunk = tl.cdiv(tl.cdiv(length - first, num_splits), BLOCK_N) * BLOCK_N
    begin = first + split * chunk
    end = tl.minimum(begin + chunk, length)
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    main = tl.arange(0, D_MAIN_PAD)
    q_main = tl.load(q_rows + main[None, :], mask=head_ok[:, None] & (main[None, :] < D_MAIN), other=0.0)  # [H, Dm]
    if D_TAIL_PAD > 0:
        tail = tl.arange(0, D_TAIL_PAD)
        q_tail = tl.load(q_rows + D_MAIN + tail[None, :], mask=head_ok[:, None] & (tail[None, :] < D_TAIL),
                         other=0.0)                                                                      # [H, Dt]
    v_dims = tl.arange(0, DV_PAD)
    keys_idx = tl.arange(0, BLOCK_N)
    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS:   # split 0 holds the sink: a key of logit sink[head] and value zero
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        running_max = tl.where(split == 0, sink, running_max)
        running_sum = tl.where(split == 0, 1.0, running_sum)
    acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
    for block_start in range(begin, end, BLOCK_N):
        key_pos = block_start + keys_idx                                   # [N]
        key_ok = key_pos < end
        page = tl.load(tables_ptr + seq * stride_tb + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_rows = k_ptr + page * stride_kb + slot * stride_ks + kv_head * stride_kh                     # [N]
        scores = channel_scores(q_main, k_rows, key_ok, main, 0, D_MAIN, USE_DOT, PRECISION)             # [H, N]
        if D_TAIL_PAD > 0:
            scores += channel_scores(q_tail, k_rows, key_ok, tail, D_MAIN, D_TAIL, USE_DOT, PRECISION)
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        probs, correction, new_max, running_sum = online_softmax_step(scores, running_max, running_sum)  # [H, N]
        v_rows = v_ptr + page * stride_vb + slot * stride_vs + kv_head * stride_vh
        acc = fold_values(acc, probs, correction, v_rows, key_ok, v_dims, V_DIM, USE_DOT, PRECISION)
        running_max = new_max
    live = running_sum > 0                                                 # an empty split (or context) has none
    out = acc / tl.where(live, running_sum, 1.0)[:, None]                  # [H, Dv]
    v_ok = head_ok[:, None] & (v_dims[None, :] < V_DIM)
    if DIRECT:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + v_dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=v_ok)
    else:
        tl.store(part_out_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + v_dims[None, :],
                 out, mask=v_ok)
        lse = tl.where(live, running_max + tl.log(tl.where(live, running_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    V_DIM: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * out_s over one (sequence, head)'s splits; all empty -> zeros."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, S_PAD)
    v_dims = tl.arange(0, DV_PAD)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))                                     # [S]
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)                                            # [S], 0 for empty splits
    parts = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + v_dims[None, :],
                    mask=split_ok[:, None] & (weights[:, None] > 0) & (v_dims[None, :] < V_DIM), other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)   # [Dv]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + v_dims, out.to(out_ptr.dtype.element_ty),
             mask=v_dims < V_DIM)


@dataclass(frozen=True)
class DecodeSplitPolicy:
    """How many context splits a decode launch uses: enough (sequence, head block, split) programs to reach
    `target_programs`, at most one per `block_n` keys of a full block table and at most `max_splits`."""

    target_programs: int
    max_splits: int = 64

    def splits(self, batch: int, head_programs: int, table_width: int, block_size: int, block_n: int) -> int:
        programs = max(batch * head_programs, 1)
        wanted = triton.cdiv(self.target_programs, programs)
        fits = max(1, table_width * block_size // block_n)
        return max(1, min(wanted, fits, self.max_splits))


@functools.lru_cache(maxsize=None)
def _target_programs(device_type: str, device_index: int | None) -> int:
    if device_type == "cuda" and not running_in_interpreter():
        return 2 * torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 8


@torch.compiler.assume_constant_result
def target_programs(device_type: str, device_index: int | None) -> int:
    """Two programs per SM on a GPU (read once per device), a small target in the interpreter. A constant to
    torch.compile: a captured decode step bakes its split count in, as it bakes in the batch bucket."""
    return _target_programs(device_type, device_index)


@torch.compiler.assume_constant_result
def interpreted() -> bool:
    return running_in_interpreter()


def decode_tiles(group: int, padded_dim: int, v_dim: int) -> tuple[int, int]:
    """(query heads per program, keys per step): up to 16 heads of a group (tl.dot's smallest tile; MLA's 128
    heads make 8 head blocks), 32 keys for wide (MLA) heads, 64 otherwise."""
    block_h = min(max(triton.next_power_of_2(group), 1), 16)
    if interpreted():
        return block_h, 16
    return block_h, 32 if max(padded_dim, v_dim) > 256 else 64


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           key_starts: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:   # [B, Hq, Dv]
    """`key_starts` [B] int32: each row's first key (None: 0); `sinks` [Hq] fp32 (None: none); `num_splits`:
    None = `split_policy`'s choice; tests force a count."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, key_starts, sinks)
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
    split = head_dim_split(head_dim)
    block_h, block_n = decode_tiles(group, split.padded, v_dim)
    head_blocks = triton.cdiv(group, block_h)
    if num_splits is None:
        policy = DecodeSplitPolicy(target_programs(q.device.type, q.device.index))
        num_splits = policy.splits(batch, num_kv_heads * head_blocks, block_tables.shape[1],
                                                   block_size, block_n)
    dv_pad = max(16, triton.next_power_of_2(v_dim))
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out                                          # unused
    else:
        part_out = torch.empty(batch, num_q_heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    use_dot = block_h >= 16
    paged_decode_split_kernel[(batch, num_kv_heads * head_blocks, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if key_starts is None else key_starts,
        out if sinks is None else sinks.float().contiguous(), out, part_out, part_lse, float(scale), num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if not direct else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_SIZE=block_size,
        D_MAIN=split.main, D_MAIN_PAD=split.main_padded, D_TAIL=split.tail, D_TAIL_PAD=split.tail_padded,
        V_DIM=v_dim, DV_PAD=dv_pad, BLOCK_H=block_h, BLOCK_N=block_n, USE_DOT=use_dot, DIRECT=direct,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=8 if dv_pad >= 512 else 4,
        HAS_STARTS=key_starts is not None, HAS_SINKS=sinks is not None,
    )
    if not direct:
        merge_splits_kernel[(batch, num_q_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), V_DIM=v_dim, DV_PAD=dv_pad, S_PAD=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
