"""Varlen prefill attention over a paged KV cache: the packed new query rows of several sequences, each
attending causally to its whole cached context (earlier chunks, prefix-cache hits) and to itself.

`PagedPrefillBatch` is the kernel's input in the cu_seqlens form flash-attention, FlashInfer and the
Triton kernel (`triton_impl/paged_prefill_attention.py`) share: sequence b owns query rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) and its context is context_lens[b] tokens, the new ones last, in
the cache blocks of block_tables[b]. The torch function here is the Triton kernel's twin and oracle-side
reference: one exact softmax per sequence (`prefix_causal_attention`: the CPU flash kernel, prefix and
chunk merged by their log-sum-exp), a Python loop, which is what one varlen launch replaces on a GPU.

A layer's span (`KeySpan`: sliding window, chunk) and attention sinks apply as in `span_causal_attention`:
each sequence's context is gathered only from the first key its first new query reads, so freed blocks of a
windowed KV cache group (the scratch block) are never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from .key_span import KeySpan, is_windowed
from .prefix_causal_attention import span_causal_attention


@dataclass(frozen=True)
class PagedPrefillBatch:
    """Which query rows belong to which sequence, and where each sequence's context lies."""

    cu_seqlens_q: torch.Tensor    # [B + 1] int32 on the device: row offsets into the packed queries
    block_tables: torch.Tensor    # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor    # [B] int32 on the device: cached tokens after this step (new ones included)
    query_lens: tuple[int, ...]   # [B] on the host: the grid's size and FlashInfer's plan read them there
    context_lens_host: tuple[int, ...]   # [B] on the host
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
              block_size: int) -> "PagedPrefillBatch":
        if len(query_lens) != len(context_lens) or block_tables.shape[0] != len(query_lens):
            raise ValueError(f"{len(query_lens)} query lengths, {len(context_lens)} context lengths and "
                             f"{block_tables.shape[0]} block table rows must agree")
        if any(q > c for q, c in zip(query_lens, context_lens)):
            raise ValueError(f"a sequence has more new tokens than context: {query_lens} vs {context_lens}")
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)
        device = block_tables.device
        return cls(torch.tensor(starts, dtype=torch.int32, device=device), block_tables,
                   torch.tensor(context_lens, dtype=torch.int32, device=device), tuple(query_lens),
                   tuple(context_lens), block_size)


def check_prefill_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         batch: PagedPrefillBatch) -> None:
    if q.dim() != 3 or q.shape[0] != batch.num_tokens:
        raise ValueError(f"q must be [T={batch.num_tokens}, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         "[blocks, block_size, Hkv, D] and [blocks, block_size, Hkv, Dv]")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)} (head dim, head groups)")
    if k_cache.shape[1] != batch.block_size:
        raise ValueError(f"cache block size {k_cache.shape[1]} != batch block size {batch.block_size}")


def sequence_context(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int,
                     start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached keys [L - start, Hkv, D] and values at positions [start, length), gathered
    contiguously (the blocks before `start`'s are not read)."""
    block_size = k_cache.shape[1]
    first = start // block_size
    blocks = table[first : (length + block_size - 1) // block_size].long()
    skip = start - first * block_size
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[skip : length - first * block_size]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[skip : length - first * block_size]
    return keys, values


def paged_prefill_attention(
    q: torch.Tensor,             # [T, Hq, D]: the packed new rows of batch's sequences
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, Dv] (MLA: a prefix view of k_cache)
    batch: PagedPrefillBatch,
    scale: float,
    span: KeySpan | None = None,     # None: full attention
    sinks: torch.Tensor | None = None,   # [Hq] fp32: gpt-oss's per-head sink logits
) -> torch.Tensor:               # [T, Hq, Dv]
    check_prefill_inputs(q, k_cache, v_cache, batch)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    start = 0
    for seq, (length, context) in enumerate(zip(batch.query_lens, batch.context_lens_host)):
        if length == 0:
            continue
        # the first key this sequence's first new query reads: what comes before is never gathered
        first = span.first_needed(context - length) if is_windowed(span) else 0
        keys, values = sequence_context(k_cache, v_cache, batch.block_tables[seq], context, first)
        q_seq = q[start : start + length].transpose(0, 1)[None]          # [1, Hq, n, D]
        k_seq = keys.transpose(0, 1)[None].to(q.dtype)                   # [1, Hkv, S', D]
        v_seq = values.transpose(0, 1)[None].to(q.dtype)                 # [1, Hkv, S', Dv]
        seq_out = span_causal_attention(q_seq, k_seq, v_seq, scale, span, sinks, first)
        out[start : start + length] = seq_out[0].transpose(0, 1)
        start += length
    return out
