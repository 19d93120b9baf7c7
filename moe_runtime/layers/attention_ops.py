"""Attention over a varlen batch whose context lives in the paged KV cache (torch path)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moe_runtime.attention_batch import AttentionBatch

KVFetcher = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # seq -> (keys [S, Hkv, D], values [S, Hkv, Dv])


def varlen_causal_attention(
    q: torch.Tensor,             # [T, Hq, D]
    batch: AttentionBatch,
    fetch_kv: KVFetcher,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:               # [T, Hq, Dv]
    """Each sequence's new queries attend causally to its whole cached context."""
    outputs = []
    for seq in range(batch.num_seqs):
        start, length = batch.query_start[seq], batch.query_lens[seq]
        keys, values = fetch_kv(seq)
        context = keys.shape[0]
        q_seq = q[start : start + length].transpose(0, 1)[None]  # [1, Hq, n, D]
        k_seq = keys.transpose(0, 1)[None]                        # [1, Hkv, S, D]
        v_seq = values.transpose(0, 1)[None]                      # [1, Hkv, S, Dv]
        gqa = q_seq.shape[1] != k_seq.shape[1]
        if length == context and sliding_window is None:
            out = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            query_pos = torch.arange(context - length, context, device=q.device)[:, None]  # [n, 1]
            key_pos = torch.arange(context, device=q.device)[None, :]                      # [1, S]
            allowed = key_pos <= query_pos
            if sliding_window is not None:
                allowed &= key_pos > query_pos - sliding_window
            out = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        outputs.append(out[0].transpose(0, 1))  # [n, Hq, Dv]
    if not outputs:
        return q.new_zeros(0, q.shape[1], 0)
    return torch.cat(outputs, dim=0)


def window_exceeded(batch: AttentionBatch, sliding_window: int | None) -> bool:
    return sliding_window is not None and max(batch.context_lens, default=0) > sliding_window
