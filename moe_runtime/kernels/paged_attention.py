"""Single-token (decode) attention over a paged KV cache, vectorized torch version.

Two options the late-2026 models need (the Triton kernel takes the same): `key_starts` [B], each row's first
key position (a sliding window's or a chunk's, computed by the caller: `AttentionBatch` on the host, or a
captured step on the device), and `sinks` [Hq], gpt-oss's per-head logits that join every row's softmax
denominator with no value. Keys before a row's start may lie in freed blocks of a windowed KV cache group
(the scratch block, holding anything): their scores are masked and their values zeroed, so a NaN there
cannot reach the output through a zero probability.
"""
from __future__ import annotations

import torch


def check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, key_starts=None, sinks=None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache [blocks, block_size, Hkv, D] and v_cache [blocks, block_size, Hkv, Dv] disagree: "
            f"{tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != k_cache head dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(
            f"block_tables must be [B={q.shape[0]}, max_blocks] and context_lens [B], got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    if key_starts is not None and key_starts.shape != (q.shape[0],):
        raise ValueError(f"key_starts must be [B={q.shape[0]}], got {tuple(key_starts.shape)}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq={q.shape[1]}], got {tuple(sinks.shape)}")


def _head_major_fp32(blocks: torch.Tensor) -> torch.Tensor:
    """[n, bs, Hkv, D] -> contiguous fp32 [Hkv, n, bs, D] in one copy (transpose and upcast together)."""
    out = torch.empty(blocks.shape[2], blocks.shape[0], blocks.shape[1], blocks.shape[3],
                      dtype=torch.float32, device=blocks.device)
    return out.copy_(blocks.permute(2, 0, 1, 3))


def paged_decode_attention(
    q: torch.Tensor,             # [B, Hq, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    key_starts: torch.Tensor | None = None,   # [B] int32: each row's first key position (None: 0)
    sinks: torch.Tensor | None = None,        # [Hq] fp32 sink logits (None: no sinks)
) -> torch.Tensor:               # [B, Hq, Dv]
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, key_starts, sinks)
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads, v_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return q.new_zeros(0, num_q_heads, v_dim)
    # Every column of the table is attended (masked past each length): reading the longest context off the device
    # would stall a GPU and break a captured step, and the caller cuts the table to its sequences' widest context.
    num_blocks = block_tables.shape[1]
    length = num_blocks * block_size
    tables = block_tables[:, :num_blocks].long().clamp(min=0).reshape(-1)           # [B * nb]
    # Gather head-major ([Hkv, B*nb, bs, D] is [Hkv*B, L, D] contiguous): the score and value
    # matmuls then run as plain bmm over (head, sequence) with no transposed copy of K or V.
    keys = _head_major_fp32(k_cache.index_select(0, tables))                        # [Hkv, B*nb, bs, D]
    keys = keys.view(num_kv_heads * batch, length, head_dim)                        # [Hkv*B, L, D]
    # Dynamo cannot compare data pointers: a captured step gathers MLA's values as their own view of the keys.
    if not torch.compiler.is_compiling() and v_cache.data_ptr() == k_cache.data_ptr() \
            and v_cache.stride() == k_cache.stride():
        values = keys[..., :v_dim]                                                  # MLA: values are the latent keys
    else:
        values = _head_major_fp32(v_cache.index_select(0, tables))
        values = values.view(num_kv_heads * batch, length, v_dim)                   # [Hkv*B, L, Dv]
    q_by_head = q.float().view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    q_by_head = q_by_head.reshape(num_kv_heads * batch, group, head_dim)
    scores = torch.bmm(q_by_head, keys.transpose(1, 2)).mul_(scale)                # [Hkv*B, G, L]
    scores = scores.view(num_kv_heads, batch, group, length)
    positions = torch.arange(length, device=q.device)
    invalid = positions[None, :] >= context_lens.long()[:, None]                    # [B, L]
    if key_starts is not None:
        invalid |= positions[None, :] < key_starts.long()[:, None]
        # zero in place (MLA's values are a view of the keys, whose scores were computed and are masked below)
        values.view(num_kv_heads, batch, length, v_dim).masked_fill_(invalid[None, :, :, None], 0.0)
    scores.masked_fill_(invalid[None, :, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)                      # empty contexts -> 0
    else:   # softmax over [scores, sink], sink column dropped: exp(score - logaddexp(lse, sink))
        sink = sinks.float().view(num_kv_heads, 1, group, 1)
        total = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)   # [Hkv, B, G, 1]
        probs = torch.exp(scores - total)                                           # masked -> 0
    out = torch.bmm(probs.view(num_kv_heads * batch, group, length), values)        # [Hkv*B, G, Dv]
    out = out.view(num_kv_heads, batch, group, v_dim).transpose(0, 1)               # [B, Hkv, G, Dv]
    return out.reshape(batch, num_q_heads, v_dim).to(q.dtype)
