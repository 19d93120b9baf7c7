"""DeepSeek-V4's lightning indexer (CSA layers): picks the `index_topk` compressed entries each query attends to.

Its keys are entries of its own overlapping compressor at `index_head_dim` (moe_runtime/layers/kv_compressor.py);
its queries come from the attention's query latent (`wq_b`), rotated by the "compress" rotary; a query's score of
an entry is sum_h w_h * relu(q_h . k) / sqrt(index_head_dim), w = weights_proj(x) / sqrt(heads)
(transformers' DeepseekV4Indexer / DeepseekV4IndexerScorer). Only complete entries before the query count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.layers.kv_compressor import KVCompressor
from moe_runtime.layers.lightning_indexer import top_k_over_widths
from moe_runtime.layers.linear import Linear
from moe_runtime.layers.v4_rotary import V4Rotary


@dataclass(frozen=True)
class IndexerShape:
    hidden_size: int
    q_lora_rank: int
    num_heads: int
    head_dim: int
    top_k: int
    rate: int

    @classmethod
    def from_config(cls, cfg) -> "IndexerShape":
        return cls(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk,
                   cfg.compress_rates["compressed_sparse_attention"])


@dataclass
class IndexQueries:
    queries: torch.Tensor   # [T, heads, D]
    weights: torch.Tensor   # [T, heads] float32

    def rows(self, start: int, stop: int) -> "IndexQueries":
        return IndexQueries(self.queries[start:stop], self.weights[start:stop])


class V4Indexer(nn.Module):
    def __init__(self, shape: IndexerShape, eps: float, rotary: V4Rotary, dtype, device, quant=None):
        super().__init__()
        self.shape = shape
        self.wq_b = Linear(shape.q_lora_rank, shape.num_heads * shape.head_dim, False, dtype, device, quant=quant)
        self.weights_proj = Linear(shape.hidden_size, shape.num_heads, False, dtype, device, quant=quant)
        self.compressor = KVCompressor(shape.hidden_size, shape.head_dim, shape.rate, True, eps, rotary, dtype,
                                       device, quant)
        self.rotary = rotary

    def queries(self, positions: torch.Tensor, x: torch.Tensor, q_latent: torch.Tensor) -> IndexQueries:
        s = self.shape
        q = self.wq_b(q_latent).view(x.shape[0], s.num_heads, s.head_dim)
        weights = self.weights_proj(x).float() * s.num_heads ** -0.5                          # [T, heads]
        return IndexQueries(self.rotary.rotate(q, positions), weights)

    def choose(self, queries: IndexQueries, keys: torch.Tensor, positions: torch.Tensor,
               widths: list[int] | None = None) -> torch.Tensor:
        """[n, count] bool: the entries each query (at `positions` [n]) attends to, of keys [count, D]; `widths`:
        how many tokens wide each query's top-k row is (`AttentionBatch.index_row_widths`: a prompt token's the
        whole prompt's entries, whatever chunk it runs in; None: `count` entries), see top_k_over_widths."""
        s = self.shape
        count = keys.shape[0]
        chosen = torch.zeros(positions.shape[0], count + 1, dtype=torch.bool, device=keys.device)
        if count == 0:
            return chosen[:, :count]
        scores = torch.relu(torch.einsum("nhd,ed->nhe", queries.queries.float(), keys.float())) * s.head_dim ** -0.5
        scores = (scores * queries.weights[:, :, None]).sum(dim=1)                             # [n, count]
        ready = torch.arange(count, device=keys.device)[None, :] < ((positions + 1) // s.rate)[:, None]
        picks = top_k_over_widths(scores.masked_fill(~ready, float("-inf")), s.top_k,
                                  None if widths is None else [width // s.rate for width in widths])
        return chosen.scatter_(1, picks.masked_fill(picks < 0, count), True)[:, :count] & ready   # -1: none
