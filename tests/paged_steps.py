"""A hand-built step over a paged cache for the attention-layer tests: an `AttentionBatch` whose sequences' new
tokens are the last `query_lens[i]` of their `context_lens[i]`, their slots read from fixed block tables."""
from __future__ import annotations

import torch

from moe_runtime.layers.attention_batch import AttentionBatch


def paged_step(tables: torch.Tensor, block_size: int, query_lens: list[int],
               context_lens: list[int]) -> tuple[AttentionBatch, torch.Tensor]:
    """(a fresh batch, each new token's position [T]) for sequences with block tables `tables` [B, W]."""
    starts, slots, positions = [0], [], []
    for seq, (n, context) in enumerate(zip(query_lens, context_lens)):
        starts.append(starts[-1] + n)
        for pos in range(context - n, context):
            slots.append(int(tables[seq, pos // block_size]) * block_size + pos % block_size)
            positions.append(pos)
    batch = AttentionBatch(list(query_lens), list(context_lens), starts, torch.tensor(slots), tables,
                           torch.tensor(context_lens, dtype=torch.int32), block_size)
    return batch, torch.tensor(positions)
