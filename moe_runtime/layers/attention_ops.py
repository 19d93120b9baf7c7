"""Attention over a varlen batch whose context lives in the paged KV cache (the torch path, a loop over
sequences, and the one-launch varlen kernel of the attention backend), and the split of a mixed batch
(decodes next to prefill chunks) between the paged decode kernel and that path.

Each takes the layer's span (`AttentionSpan`: full, sliding window, chunk; an int is taken as a sliding
window, None as full) and optional sinks ([Hq] fp32, gpt-oss). Windowed one-token rows run in the decode
kernel from their own first key (computed per sequence on the host, or on the device in a captured step)."""
from __future__ import annotations

from typing import Callable

import torch

from moe_runtime.kernels.prefix_causal_attention import span_causal_attention
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_backend import PrefillAttention
from moe_runtime.layers.attention_span import AttentionSpan

KVFetcher = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # seq -> (keys [S, Hkv, D], values [S, Hkv, Dv])
# (token rows or None for all, block tables [S, max_blocks], context lens [S][, key starts [S]]) -> out [S, Hq, Dv];
# the key starts are passed for windowed spans only (full-attention callers, MLA, take three arguments)
SingleQueryAttention = Callable[..., torch.Tensor]
# batch indices or None for all -> out [rows of those sequences, Hq, Dv]
VarlenAttention = Callable[[list[int] | None], torch.Tensor]


def varlen_causal_attention(
    q: torch.Tensor,             # [T, Hq, D]
    batch: AttentionBatch,
    fetch_kv: KVFetcher,
    scale: float,
    span: AttentionSpan | int | None = None,
    seqs: list[int] | None = None,
    sinks: torch.Tensor | None = None,   # [Hq] fp32 sink logits
) -> torch.Tensor:               # [rows of `seqs`, Hq, Dv]
    """Each sequence's new queries attend causally (within `span`) to its cached context (the tokens before
    them, cached by earlier steps or by an earlier chunk, and themselves). `seqs`: only these sequences
    (default all), their rows concatenated in that order. Keys before the first one a sequence's queries read
    are dropped before any matmul (a windowed KV cache group's freed blocks hold anything)."""
    span = AttentionSpan.coerce(span)
    outputs = []
    for seq in range(batch.num_seqs) if seqs is None else seqs:
        start, length = batch.query_start[seq], batch.query_lens[seq]
        keys, values = fetch_kv(seq)
        first = span.first_needed(keys.shape[0] - length)
        q_seq = q[start : start + length].transpose(0, 1)[None]  # [1, Hq, n, D]
        k_seq = keys[first:].transpose(0, 1)[None]                # [1, Hkv, S', D]
        v_seq = values[first:].transpose(0, 1)[None]              # [1, Hkv, S', Dv]
        out = span_causal_attention(q_seq, k_seq, v_seq, scale, span, sinks, first)
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
    span: AttentionSpan | int | None = None,
    seqs: list[int] | None = None,
    rows_selected: bool = False,
    sinks: torch.Tensor | None = None,   # [Hq] fp32 sink logits
) -> torch.Tensor:               # [rows of `seqs`, Hq, Dv]
    """`varlen_causal_attention`'s result from one varlen kernel launch over the paged cache. `rows_selected`:
    q holds only the rows of `seqs` already (MLA absorbs the queries of those rows only)."""
    span = AttentionSpan.coerce(span)
    rows, prefill_batch = batch.prefill_batch(seqs)
    if rows is not None and not rows_selected:
        q = q[rows]
    return prefill(q, k_cache, v_cache, prefill_batch, scale, span if span.windowed else None, sinks)


def split_attention(batch: AttentionBatch, span: AttentionSpan | int | None, single: SingleQueryAttention,
                    varlen: VarlenAttention) -> torch.Tensor:   # [T, Hq, Dv]
    """Attention of a whole batch: one-token sequences through `single` (the paged decode kernel, batched; under
    a windowed span from each row's first key), the rest through `varlen`. A pure decode or pure prefill batch
    goes to one of them whole."""
    span = AttentionSpan.coerce(span)
    if batch.static_decode:      # a captured decode step: every row a single query, first keys from the device
        if span.windowed:
            return single(None, batch.block_tables, batch.context_lens_tensor, batch.decode_key_starts(span))
        return single(None, batch.block_tables, batch.context_lens_tensor)
    split = batch.split_single_queries(span)
    if not split.single:
        return varlen(None)
    if span.windowed:
        single_out = single(None if not split.multi else split.single_rows, split.block_tables, split.context_lens,
                            split.key_starts)                                          # [S, Hq, Dv]
    elif not split.multi:
        return single(None, batch.block_tables, batch.context_lens_tensor)
    else:
        single_out = single(split.single_rows, split.block_tables, split.context_lens)  # [S, Hq, Dv]
    if not split.multi:
        return single_out
    varlen_out = varlen(split.multi)                                                   # [M, Hq, Dv]
    out = single_out.new_empty(batch.num_tokens, *single_out.shape[1:])               # [T, Hq, Dv]
    out[split.single_rows] = single_out
    out[split.multi_rows] = varlen_out.to(out.dtype)
    return out
