"""Multi-head latent attention over the tokens a lightning indexer chose (DeepSeek Sparse Attention: DeepSeek-V3.2,
GLM-5).

Each query attends to at most `index_topk` tokens of its sequence, those its layer's indexer scored best among
the tokens at or before it (moe_runtime/layers/lightning_indexer.py), in prefill, chunked prefill and decode
alike. Attention is MLA's absorbed form: the latents of the chosen tokens are gathered from the paged cache and
the queries, W_UK folded in, attend to them in the latent space. A GLM-5 "shared" layer has no indexer of its
own: it reuses the tokens the last indexer layer below it chose in the same step (kept on the step's
`AttentionBatch`, so two micro-batches in flight keep theirs apart), and caches no index keys.

The index keys live in the layer's cache beside the latents, one per token, in the same blocks and slots
(`KVCacheSpec.value_dim`): the full group's block table allocates them, the prefix cache keeps them with the
latents, the cache budget counts their bytes, and a P/D transfer moves them with the blocks.

The choice runs per sequence (in bounded slabs of query rows; the scores through the backend's `index_scores`,
the top-k in torch, over rows as wide as a one-step prefill's: a chunk's prompt tokens choose among tied keys as
the whole prompt's prefill does, lightning_indexer.top_k_over_widths), or, in a captured decode step (no host
lists), for every row at once over the span its block table covers; the attention over the chosen tokens is one
call of the attention backend's sparse kernel for the whole step (moe_runtime/kernels/sparse_latent_attention.py, or its Triton
twin).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime.kernels.sparse_latent_attention import slab_rows
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.lightning_indexer import IndexQueries, LightningIndexer, TokenSelection
from moe_runtime.layers.mla import MultiHeadLatentAttention


class SparseLatentAttention(MultiHeadLatentAttention):
    def __init__(self, *args, indexer: LightningIndexer | None, selecting_layer: int, **kwargs):
        """MLA's arguments, and `indexer` (None: reuse the tokens layer `selecting_layer`, an indexer layer
        below, chose this step; with an indexer, `selecting_layer` is this layer's own index)."""
        super().__init__(*args, **kwargs)
        if self.shape.q_lora_rank is None:
            raise ValueError("sparse MLA projects its index queries from the query latent: it needs q_lora_rank")
        self.indexer = indexer
        self.selecting_layer = selecting_layer

    def kv_cache_spec(self) -> KVCacheSpec:
        """Per token the latent and rotated key (keys), and the index key (the second tensor) where this layer
        has an indexer."""
        s = self.shape
        index_dim = None if self.indexer is None else self.indexer.shape.head_dim
        return KVCacheSpec(1, s.kv_lora_rank + s.qk_rope_head_dim, index_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache):
        s = self.shape
        num_tokens = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x))                                 # [T, q_lora]
        q = self.q_b_proj(q_latent).view(num_tokens, self.num_heads, s.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)      # [T, h, nope], [T, h, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)                                            # [T, L]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None, :])                     # [T, h, rope], [T, 1, rope]
        index_queries = index_keys = None
        if self.indexer is not None:
            index_queries, index_keys = self.indexer.project(positions, x, q_latent)    # [T, heads, D], [T, D]
            index_keys = index_keys[:, None, :]                                         # [T, 1, D]
        batch.write_kv(cache, torch.cat([latent[:, None, :], k_pe], dim=-1), index_keys)
        out_latent = self._attend_chosen(self._absorbed_queries(q_nope, q_pe), index_queries, batch, cache)
        out = self._values_of_latent(out_latent)                                        # [T, h, v]
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * s.v_head_dim))
        if self.tp_size > 1:
            out = self.o_proj.reduce(out, self.tp_group)
        return out

    def _attend_chosen(self, q_full: torch.Tensor, index_queries: IndexQueries | None, batch: AttentionBatch,
                       cache: LayerKVCache) -> torch.Tensor:   # q_full [T, h, L + rope] -> [T, h, L]
        """Every row over the cache slots of the tokens chosen for it (chosen here, or by the selecting layer
        earlier in this step), in one call of the attention backend's sparse kernel."""
        s = self.shape
        if self.indexer is None:
            step_slots = batch.token_selections[self.selecting_layer]                   # [T, K]
        elif batch.static_decode:
            step_slots = self._choose_for_decode_rows(index_queries, batch, cache)
        else:
            step_slots = self._choose_per_sequence(index_queries, batch, cache)
        batch.token_selections[self.selecting_layer] = step_slots
        entries = cache.keys.view(-1, s.kv_lora_rank + s.qk_rope_head_dim)             # [slots, L + rope]
        return self._attention.sparse_latent(q_full, entries, step_slots, self.scale, s.kv_lora_rank)

    def _choose_per_sequence(self, queries: IndexQueries, batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:
        """[T, K] cache slots of each row's chosen tokens (-1: none; K the widest choice), sequence by sequence."""
        index_keys = cache.values.view(-1, cache.values.shape[-1])                      # [slots, D]
        chosen_slots = []
        for seq in range(batch.num_seqs):
            start, count, context = batch.query_start[seq], batch.query_lens[seq], batch.context_lens[seq]
            if count == 0:
                continue
            slots = batch.context_slots(seq)                                            # [S]
            chosen = self._choose(queries.rows(start, start + count), index_keys.index_select(0, slots), context,
                                  batch.index_row_widths(seq))
            chosen_slots.append(torch.where(chosen.valid, slots[chosen.positions], -1))   # [n, k]
        width = max((c.shape[1] for c in chosen_slots), default=1)
        if not chosen_slots:
            return queries.queries.new_zeros(0, width, dtype=torch.long)
        return torch.cat([F.pad(c, (0, width - c.shape[1]), value=-1) for c in chosen_slots])

    def _choose(self, queries: IndexQueries, index_keys: torch.Tensor, context: int,
                widths: list[int] | None) -> TokenSelection:
        """The indexer's choice for one sequence's new queries (the last `n` positions of its context, whose
        index keys [S, D] are given), slab by slab of query rows; `widths`: each row's top-k width
        (`AttentionBatch.index_row_widths`)."""
        count = queries.queries.shape[0]
        positions = torch.arange(context - count, context, device=index_keys.device)    # [n]
        step = slab_rows(self.indexer.shape.num_heads * max([context, *(widths or ())]))   # index scores
        parts = [self.indexer.select(queries.rows(first, first + step), index_keys, positions[first:first + step],
                                     None if widths is None else widths[first:first + step])
                 for first in range(0, count, step)]
        if len(parts) == 1:
            return parts[0]
        width = max(p.positions.shape[1] for p in parts)
        return TokenSelection(torch.cat([F.pad(p.positions, (0, width - p.positions.shape[1])) for p in parts]),
                              torch.cat([F.pad(p.valid, (0, width - p.valid.shape[1])) for p in parts]))

    def _choose_for_decode_rows(self, queries: IndexQueries, batch: AttentionBatch,
                                cache: LayerKVCache) -> torch.Tensor:   # -> [B, K] slots
        """A captured decode step's choice (each row one sequence's new token, the host lists empty): every row
        scores the keys its block table covers, those past its context masked, all on the device. A pad row
        (context 0) chooses nothing."""
        bs = batch.block_size
        tables = batch.block_tables.long()                                              # [B, W]
        positions = torch.arange(tables.shape[1] * bs, device=tables.device)           # [P]
        slots = tables.clamp(min=0)[:, positions // bs] * bs + positions % bs           # [B, P]
        index_keys = cache.values.view(-1, cache.values.shape[-1])[slots]               # [B, P, D]
        chosen = self.indexer.select(queries, index_keys, batch.context_lens_tensor.long() - 1)
        return torch.where(chosen.valid, slots.gather(1, chosen.positions), -1)
