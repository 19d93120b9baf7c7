"""DeepSeek Sparse Attention's lightning indexer: which earlier tokens each query of a layer attends to.

Every token leaves one index key [index_head_dim] in the layer's paged cache, beside its MLA latent (same blocks,
same slots: `KVCacheSpec.value_dim` of a sparse layer): its own projection of the hidden state, LayerNorm-ed,
its first qk_rope_head_dim channels rotated. A query has `index_n_heads` index queries (projected from MLA's
query latent, rotated alike) and as many weights (projected from the hidden state, in fp32); its score for an
earlier key is sum_h weight_h * relu(q_h . k / sqrt(index_head_dim)), the weights scaled by 1/sqrt(heads).
The `index_topk` best-scoring keys at or before the query's position are the tokens it attends to.

The reference kernels rotate q and k by a Hadamard matrix and score in FP8; transformers leaves both out (the
rotation keeps every dot product, FP8 is a precision trade), and so does this layer: its tokens are transformers'.

Scores tie exactly (a key every head's ReLU zeroes scores 0, frequent with few index heads), and which tied keys
torch.topk keeps depends on the whole row it is given, masked entries included. So each query's top-k is taken over
a row as wide as a one-step prefill gives it (`top_k_over_widths`, `AttentionBatch.index_row_widths`): a prompt
token's as wide as the whole prompt, whatever chunk of a chunked prefill it is in, a later token's up to itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.kernels.index_scores import index_scores
from moe_runtime.layers.attention_backend import IndexScores
from moe_runtime.layers.linear import Linear
from moe_runtime.layers.norm import LayerNorm
from moe_runtime.layers.rotary import RotaryEmbedding
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization

INDEX_KEY_NORM_EPS = 1e-6   # transformers builds the indexer's k_norm with this eps


@dataclass(frozen=True)
class IndexerShape:
    hidden_size: int
    q_lora_rank: int
    num_heads: int        # index_n_heads
    head_dim: int         # index_head_dim
    rope_dim: int         # qk_rope_head_dim: the rotated leading channels of each index query and key
    topk: int             # index_topk

    @classmethod
    def from_config(cls, cfg) -> "IndexerShape":
        return cls(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                   cfg.index_topk)


@dataclass(frozen=True)
class IndexQueries:
    """A step's index queries and their per-head weights."""

    queries: torch.Tensor     # [T, heads, D]
    weights: torch.Tensor     # [T, heads] fp32, already scaled by 1/sqrt(heads)

    def rows(self, start: int, stop: int) -> "IndexQueries":
        return IndexQueries(self.queries[start:stop], self.weights[start:stop])


@dataclass(frozen=True)
class TokenSelection:
    """The context tokens some queries of one sequence attend to. A query with fewer than `topk` tokens at or
    before it reads them all; its row is filled up with other positions (later ones, or 0), which `valid` masks
    out."""

    positions: torch.Tensor   # [n, k] int64: positions in the sequence's context
    valid: torch.Tensor       # [n, k] bool


class LightningIndexer(nn.Module):
    def __init__(self, shape: IndexerShape, rotary: RotaryEmbedding, dtype, device=None,
                 quant: WeightQuantization | None = None, scores: IndexScores = index_scores):
        """`scores`: the attention backend's `index_scores` (its Triton kernel, or the torch twin)."""
        super().__init__()
        s = shape
        self.shape = s
        self._scores = scores
        self.wq_b = Linear(s.q_lora_rank, s.num_heads * s.head_dim, False, dtype, device, quant=quant)
        self.wk = Linear(s.hidden_size, s.head_dim, False, dtype, device, quant=quant)
        self.k_norm = LayerNorm(s.head_dim, INDEX_KEY_NORM_EPS, dtype, device)
        # fp32 weights and input, as transformers keeps this projection (`_keep_in_fp32_modules`)
        self.weights_proj = Linear(s.hidden_size, s.num_heads, False, torch.float32, device)
        self.rotary = rotary
        self.softmax_scale = s.head_dim ** -0.5

    def project(self, positions: torch.Tensor, x: torch.Tensor,
                q_latent: torch.Tensor) -> tuple[IndexQueries, torch.Tensor]:
        """The step's index queries and its new tokens' index keys [T, D] (what the cache keeps).
        positions [T], x [T, hidden], q_latent [T, q_lora_rank] (MLA's normed query latent)."""
        s = self.shape
        queries = self.wq_b(q_latent).view(x.shape[0], s.num_heads, s.head_dim)       # [T, heads, D]
        keys = self.k_norm(self.wk(x))[:, None, :]                                     # [T, 1, D]
        cos, sin = self.rotary.cos_sin(positions, queries.dtype)
        queries = torch.cat([self.rotary.rotate(queries[..., : s.rope_dim], cos, sin), queries[..., s.rope_dim:]], -1)
        keys = torch.cat([self.rotary.rotate(keys[..., : s.rope_dim], cos, sin), keys[..., s.rope_dim:]], -1)
        weights = self.weights_proj(x.float()).float() * s.num_heads ** -0.5           # [T, heads]
        return IndexQueries(queries, weights), keys[:, 0]

    def select(self, queries: IndexQueries, keys: torch.Tensor, query_positions: torch.Tensor,
               widths: list[int] | None = None) -> TokenSelection:
        """The top-k tokens of a context for each query: queries of n rows; keys [S, D], one sequence's context in
        position order shared by its queries, or [n, S, D], each row's own; query_positions [n] (each query's own
        position: keys after it are not chosen); widths: how many tokens wide each row's top-k is taken over
        (`top_k_over_widths`; None: S)."""
        index_scores = self._scores(queries.queries, queries.weights, keys, self.softmax_scale)   # [n, S]
        key_positions = torch.arange(keys.shape[-2], device=keys.device)
        later = key_positions[None, :] > query_positions[:, None]                      # [n, S]
        index_scores = index_scores.masked_fill(later, float("-inf"))
        chosen = top_k_over_widths(index_scores, self.shape.topk, widths)              # [n, k]
        valid = (chosen >= 0) & (chosen <= query_positions[:, None])
        return TokenSelection(chosen.clamp(min=0), valid)


def top_k_over_widths(scores: torch.Tensor, k: int, widths: list[int] | None) -> torch.Tensor:
    """[n, min(k, widest row)] int64: the `k` best entries of each row of `scores` [n, C] (those a row may not
    choose at -inf), the top-k of row r taken over `widths[r]` entries: `scores` cut to them, or padded with -inf
    past C (None: every row C wide). -1 where a row picked a padded entry (only a row with fewer than k entries
    it may choose does) and past a narrower row's picks.

    A row's width is what decides among exactly tied scores: torch.topk's choice among ties depends on the whole
    row it sorts, its masked entries included. A one-step prefill scores each prompt token against the whole
    prompt, the later keys masked; a chunk of a chunked prefill has only the keys up to its end: given the
    prompt's width, its queries keep the same tied keys as the one-step prefill (and transformers)."""
    n, count = scores.shape
    if widths is None:
        return scores.topk(min(k, count), dim=-1).indices
    if len(widths) != n:
        raise ValueError(f"{len(widths)} row widths for {n} rows of scores")
    chosen = torch.full((n, min(k, max(widths, default=0))), -1, dtype=torch.long, device=scores.device)
    first = 0
    while first < n:   # runs of rows of one width: a prompt's rows share the prompt's, later rows each their own
        stop = first + 1
        while stop < n and widths[stop] == widths[first]:
            stop += 1
        width = widths[first]
        rows = scores[first:stop, :width]
        if width > count:
            rows = F.pad(rows, (0, width - count), value=float("-inf"))
        picks = rows.topk(min(k, width), dim=-1).indices                               # [rows, min(k, width)]
        chosen[first:stop, : picks.shape[1]] = picks.masked_fill(picks >= count, -1)
        first = stop
    return chosen
