"""A mixed attention batch over a paged KV cache, and its oracle: decodes (one of them past a sliding window),
prefill chunks attending to their cached context, a whole prefill and a one-token chunk, in shuffled
cache blocks. Shared by test_chunked_prefill.py (torch kernels) and triton_kernel_cases.py (the Triton
paged kernel serving the one-token rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_ops import split_attention, varlen_causal_attention

CONTEXT_LENS = [9, 3, 14, 11, 5, 13]
QUERY_LENS = [1, 1, 5, 11, 1, 4]
SCALE = 0.3


@dataclass
class MixedAttentionCase:
    batch: AttentionBatch
    q: torch.Tensor            # [T, Hq, D]
    k_cache: torch.Tensor      # [blocks, block_size, Hkv, D]
    v_cache: torch.Tensor      # [blocks, block_size, Hkv, Dv] (a view of k_cache when shared)
    window: int | None
    expected: torch.Tensor     # [T, Hq, Dv]: dense causal attention over each whole sequence


def mixed_batch(block_size: int, num_blocks: int, generator: torch.Generator, device) -> AttentionBatch:
    """Sequence b's new tokens are the last QUERY_LENS[b] of its CONTEXT_LENS[b]; blocks are shuffled."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[free.pop() for _ in range((n + block_size - 1) // block_size)] for n in CONTEXT_LENS]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    query_start, slots = [0], []
    for table, context, length in zip(tables, CONTEXT_LENS, QUERY_LENS):
        query_start.append(query_start[-1] + length)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - length, context)]
    return AttentionBatch(list(QUERY_LENS), list(CONTEXT_LENS), query_start, torch.tensor(slots, device=device),
                          block_tables, torch.tensor(CONTEXT_LENS, dtype=torch.int32, device=device), block_size)


def dense_attention(q, k, v, window):   # [S, Hq, D], [S, Hkv, D], [S, Hkv, Dv] -> [S, Hq, Dv]
    positions = torch.arange(q.shape[0])
    allowed = positions[None, :] <= positions[:, None]
    if window is not None:
        allowed &= positions[None, :] > positions[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=allowed, scale=SCALE, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def mixed_attention_case(heads: int, kv_heads: int, window: int | None, shared_kv: bool,
                         device="cpu") -> MixedAttentionCase:
    generator = torch.Generator().manual_seed(0)
    block_size, dim, v_dim = 4, 16, (12 if shared_kv else 16)
    num_blocks = sum((n + block_size - 1) // block_size for n in CONTEXT_LENS) + 2
    batch = mixed_batch(block_size, num_blocks, generator, "cpu")
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = k_cache[..., :v_dim] if shared_kv else torch.zeros(num_blocks, block_size, kv_heads, v_dim)
    q = torch.randn(batch.num_tokens, heads, dim, generator=generator)
    expected = []
    for b, (context, length) in enumerate(zip(CONTEXT_LENS, QUERY_LENS)):
        slots = batch.context_slots(b)
        k_full = torch.randn(context, kv_heads, dim, generator=generator)
        k_cache.view(-1, kv_heads, dim)[slots] = k_full
        v_full = k_full[..., :v_dim] if shared_kv else torch.randn(context, kv_heads, v_dim, generator=generator)
        if not shared_kv:
            v_cache.view(-1, kv_heads, v_dim)[slots] = v_full
        q_full = torch.randn(context, heads, dim, generator=generator)
        q_full[context - length :] = q[batch.query_start[b] : batch.query_start[b + 1]]
        expected.append(dense_attention(q_full, k_full, v_full, window)[context - length :])
    k_device = k_cache.to(device)
    v_device = k_device[..., :v_dim] if shared_kv else v_cache.to(device)
    return MixedAttentionCase(mixed_batch(block_size, num_blocks, torch.Generator().manual_seed(0), device),
                              q.to(device), k_device, v_device, window, torch.cat(expected))


def attend(kernels, case: MixedAttentionCase) -> torch.Tensor:   # [T, Hq, Dv]
    """The engine's split: one-token rows through `kernels.paged_decode_attention`, the rest through the
    torch varlen path."""
    batch, q, k_cache, v_cache = case.batch, case.q, case.k_cache, case.v_cache
    kv_heads, dim, v_dim = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]

    def fetch(seq):
        slots = batch.context_slots(seq)
        return k_cache.reshape(-1, kv_heads, dim)[slots], v_cache.reshape(-1, kv_heads, v_dim)[slots]

    def single(rows, tables, lens, key_starts=None):   # windowed rows: from their first key
        return kernels.paged_decode_attention(q if rows is None else q[rows], k_cache, v_cache, tables, lens, SCALE,
                                              key_starts=key_starts)

    return split_attention(batch, case.window, single,
                           lambda seqs: varlen_causal_attention(q, batch, fetch, SCALE, case.window, seqs))
