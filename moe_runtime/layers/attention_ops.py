"""Attention over a varlen batch whose context lives in the paged KV cache (the torch path, a loop over
sequences, and the one-launch varlen kernel of the attention backend), and the split of a mixed batch
(decodes next to prefill chunks) between the paged decode kernel and that path."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.prefix_causal_attention import prefix_causal_attention
from moe_runtime.execution.attention_batch import AttentionBatch
from moe_runtime.layers.attention_backend import PrefillAttention

KVFetcher = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # seq -> (keys [S, Hkv, D], values [S, Hkv, Dv])
# (token rows or None for all, block tables [S, max_blocks], context lens [S]) -> out [S, Hq, Dv]
SingleQueryAttention = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]
# batch indices or None for all -> out [rows of those sequences, Hq, Dv]
VarlenAttention = Callable[[list[int] | None], torch.Tensor]


def varlen_causal_attention(
    q: torch.Tensor,             # [T, Hq, D]
    batch: AttentionBatch,
    fetch_kv: KVFetcher,
    scale: float,
    sliding_window: int | None = None,
    seqs: list[int] | None = None,
) -> torch.Tensor:               # [rows of `seqs`, Hq, Dv]
    """Each sequence's new queries attend causally to its whole cached context (the tokens before them,
    cached by earlier steps or by an earlier chunk, and themselves). `seqs`: only these sequences (default all),
    their rows concatenated in that order."""
    outputs = []
    for seq in range(batch.num_seqs) if seqs is None else seqs:
        start, length = batch.query_start[seq], batch.query_lens[seq]
        keys, values = fetch_kv(seq)
        context = keys.shape[0]
        q_seq = q[start : start + length].transpose(0, 1)[None]  # [1, Hq, n, D]
        k_seq = keys.transpose(0, 1)[None]                        # [1, Hkv, S, D]
        v_seq = values.transpose(0, 1)[None]                      # [1, Hkv, S, Dv]
        gqa = q_seq.shape[1] != k_seq.shape[1]
        if sliding_window is None:   # a whole prompt, or a chunk / context-parallel piece after its cached prefix
            out = prefix_causal_attention(q_seq, k_seq, v_seq, scale)
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


def paged_varlen_attention(
    q: torch.Tensor,             # [T, Hq, D]: every new row of the step
    batch: AttentionBatch,
    prefill: PrefillAttention,
    k_cache: torch.Tensor,       # [blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [blocks, block_size, Hkv, Dv]
    scale: float,
    sliding_window: int | None = None,
    seqs: list[int] | None = None,
    rows_selected: bool = False,
) -> torch.Tensor:               # [rows of `seqs`, Hq, Dv]
    """`varlen_causal_attention`'s result from one varlen kernel launch over the paged cache. `rows_selected`:
    q holds only the rows of `seqs` already (MLA absorbs the queries of those rows only)."""
    rows, prefill_batch = batch.prefill_batch(seqs)
    if rows is not None and not rows_selected:
        q = q[rows]
    return prefill(q, k_cache, v_cache, prefill_batch, scale, sliding_window)


def split_attention(batch: AttentionBatch, sliding_window: int | None, single: SingleQueryAttention,
                    varlen: VarlenAttention) -> torch.Tensor:   # [T, Hq, Dv]
    """Attention of a whole batch: one-token sequences through `single` (the paged decode kernel, batched),
    the rest through `varlen`. A pure decode or pure prefill batch goes to one of them whole."""
    if batch.static_decode:      # a captured decode step: every row a single query (the capture checked windows)
        return single(None, batch.block_tables, batch.context_lens_tensor)
    split = batch.split_single_queries(sliding_window)
    if not split.multi:
        return single(None, batch.block_tables, batch.context_lens_tensor)
    if not split.single:
        return varlen(None)
    single_out = single(split.single_rows, split.block_tables, split.context_lens)    # [S, Hq, Dv]
    varlen_out = varlen(split.multi)                                                   # [M, Hq, Dv]
    out = single_out.new_empty(batch.num_tokens, *single_out.shape[1:])               # [T, Hq, Dv]
    out[split.single_rows] = single_out
    out[split.multi_rows] = varlen_out.to(out.dtype)
    return out
