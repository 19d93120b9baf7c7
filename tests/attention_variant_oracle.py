"""Paged attention cases with the late-2026 variants (sinks, sliding windows, chunks) and their float64 oracle,
shared by test_attention_variants.py (torch paths) and attention_variant_triton_cases.py (Triton kernels).

A case is a step of sequences over a paged cache whose block tables point, for every block entirely before
the first key the sequence's first new query reads, at one scratch block filled with `scratch_fill` (NaN by
default): what a windowed KV cache group's tables hold once those blocks are freed. The oracle never reads
the cache: it attends over each sequence's true keys, so any dependence on the scratch block shows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_span import CHUNKED, SLIDING, AttentionSpan

CHUNK = AttentionSpan(CHUNKED, 8)
WINDOW = AttentionSpan(SLIDING, 6)
FULL = AttentionSpan()


@dataclass
class VariantCase:
    q: torch.Tensor              # [T, Hq, D]
    k_cache: torch.Tensor        # [blocks, block_size, Hkv, D]
    v_cache: torch.Tensor        # [blocks, block_size, Hkv, Dv]
    tables: torch.Tensor         # [B, width] int32, -1 padded; freed entries = scratch
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    span: AttentionSpan
    sinks: torch.Tensor | None   # [Hq] fp32
    expected: torch.Tensor       # [T, Hq, Dv] float64

    def batch(self, device="cpu") -> AttentionBatch:
        """The step as the engine's attention metadata (slots of the new tokens; tables on `device`)."""
        starts, slots = [0], []
        for n, context in zip(self.query_lens, self.context_lens):
            starts.append(starts[-1] + n)
        for b, (n, context) in enumerate(zip(self.query_lens, self.context_lens)):
            for pos in range(context - n, context):
                slots.append(int(self.tables[b, pos // self.block_size]) * self.block_size + pos % self.block_size)
        return AttentionBatch(list(self.query_lens), list(self.context_lens), starts,
                              torch.tensor(slots, dtype=torch.long, device=device), self.tables.to(device),
                              torch.tensor(self.context_lens, dtype=torch.int32, device=device), self.block_size)

    def key_starts(self) -> torch.Tensor:
        """[B] int32 each sequence's last position's first key (a decode row's)."""
        return torch.tensor([self.span.first_needed(c - 1) for c in self.context_lens], dtype=torch.int32)


def oracle(q, keys, values, positions, span: AttentionSpan, sinks) -> torch.Tensor:
    """float64: q [n, Hq, D] at `positions` over one sequence's true keys [S, Hkv, D] / values; each query reads
    keys [span.first_needed(p), p]; sinks as transformers' gpt-oss applies them (a column concatenated to the
    scores, softmaxed, dropped)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    out = torch.zeros(q.shape[0], q.shape[1], values.shape[2], dtype=torch.float64)
    for i, p in enumerate(positions):
        first = span.first_needed(p)
        scores = torch.einsum("hd,shd->hs", q[i].double(), keys[first : p + 1]) * q.shape[-1] ** -0.5   # [Hq, s]
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = scores.softmax(-1)[:, : p + 1 - first]
        out[i] = torch.einsum("hs,shv->hv", probs, values[first : p + 1])
    return out


def variant_case(query_lens: list[int], context_lens: list[int], span: AttentionSpan, sinks: bool,
                 q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, block_size: int = 4, seed: int = 0,
                 scratch_fill: float = float("nan")) -> VariantCase:
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    scratch = order.pop()
    k_cache[scratch], v_cache[scratch] = scratch_fill, scratch_fill
    tables = torch.full((len(context_lens), max(needed) + 1), -1, dtype=torch.int32)
    q = torch.randn(sum(query_lens), q_heads, head_dim, generator=generator)
    sink_logits = (torch.randn(q_heads, generator=generator) * 2).float() if sinks else None
    expected, row = [], 0
    for b, (n, context) in enumerate(zip(query_lens, context_lens)):
        keys = torch.randn(context, kv_heads, head_dim, generator=generator)
        values = torch.randn(context, kv_heads, head_dim, generator=generator)
        first = span.first_needed(context - n)
        for j in range(needed[b]):
            if (j + 1) * block_size <= first:          # freed: no query of this step reads it
                tables[b, j] = scratch
                continue
            tables[b, j] = order.pop()
            stop = min((j + 1) * block_size, context)
            k_cache[tables[b, j], : stop - j * block_size] = keys[j * block_size : stop]
            v_cache[tables[b, j], : stop - j * block_size] = values[j * block_size : stop]
        expected.append(oracle(q[row : row + n], keys, values, range(context - n, context), span, sink_logits))
        row += n
    return VariantCase(q, k_cache, v_cache, tables, query_lens, context_lens, block_size, span, sink_logits,
                       torch.cat(expected))


# the cases both test files run: (query_lens, context_lens, span, sinks)
PREFILL_CASES = {
    "sinks_after_cached_context": ([5, 1, 7], [12, 1, 7], FULL, True),
    "chunked_prefill_crossing_chunks": ([11, 20, 3], [30, 20, 17], CHUNK, False),
    "chunked_with_sinks": ([11, 20], [30, 20], CHUNK, True),
    "sliding_with_sinks": ([5, 9], [21, 9], WINDOW, True),
    "sliding_after_freed_blocks": ([3, 13], [26, 27], WINDOW, False),
}
# one new token per sequence: positions at and just past chunk boundaries (7 | 8, 15 | 16, 23 | 24), past windows
DECODE_CASES = {
    "chunk_boundaries": ([1] * 8, [8, 9, 16, 17, 1, 24, 25, 7], CHUNK, False),
    "chunk_boundaries_sinks": ([1] * 6, [8, 9, 16, 17, 30, 2], CHUNK, True),
    "sliding_past_window": ([1] * 5, [3, 6, 7, 20, 33], WINDOW, False),
    "sliding_sinks": ([1] * 3, [6, 7, 29], WINDOW, True),
    "full_sinks": ([1] * 3, [1, 9, 22], FULL, True),
}
