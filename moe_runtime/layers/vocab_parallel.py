"""Embedding and LM head split over the vocabulary (dense tensor parallelism).

Rank r holds rows [r * shard, (r + 1) * shard) of the [V, H] matrix (shard = ceil(V / tp); the
last shard is zero-padded). The embedding sums the ranks' masked lookups with one all-reduce;
the LM head all-gathers the ranks' logit slices.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_runtime.kernels.skinny_matmul import linear_rows
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked


class VocabShard(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp_size: int, tp_rank: int, group, dtype, device=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = (vocab_size + tp_size - 1) // tp_size
        self.start = min(tp_rank * self.shard, vocab_size)
        self.stop = min(self.start + self.shard, vocab_size)
        self.tp_size, self.group = tp_size, group
        self.weight = nn.Parameter(torch.zeros(self.shard, dim, dtype=dtype, device=device), requires_grad=False)

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        name = f"{prefix}weight"
        rows = reader.read_slice(name, 0, self.start, self.stop)
        if rows.shape[1:] != self.weight.shape[1:]:
            copy_checked(self.weight, rows, name, reader.directory)  # raises, naming the tensor
        copy_checked(self.weight[: self.stop - self.start], rows, name, reader.directory)
        return {"weight"}


class VocabParallelEmbedding(VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        mine = (ids >= self.start) & (ids < self.stop)
        local = F.embedding((ids - self.start).clamp(0, self.shard - 1), self.weight)
        local = local * mine[:, None].to(local.dtype)
        dist.all_reduce(local, group=self.group)
        return local


class ParallelLMHead(VocabShard):
    """The LM head's vocabulary shard (with tied embeddings the embedding's shard serves instead)."""


def gather_vocab_logits(hidden: torch.Tensor, shard: VocabShard) -> torch.Tensor:  # [B, H] -> [B, V] fp32
    """Logits of every rank's vocabulary shard, all-gathered into the full vocabulary."""
    local = linear_rows(hidden, shard.weight).float()                                  # [B, shard]
    gathered = [torch.empty_like(local) for _ in range(shard.tp_size)]
    dist.all_gather(gathered, local.contiguous(), group=shard.group)
    return torch.cat(gathered, dim=-1)[:, : shard.vocab_size]
