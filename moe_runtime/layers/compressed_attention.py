"""DeepSeek-V4's attention (transformers' DeepseekV4Attention): shared-KV MQA over a sliding window, plus, on a
compressing layer, the compressed entries of the whole context (HCA: every complete entry; CSA: the `index_topk`
its lightning indexer picks per query).

Per token: a query latent (`wq_a`, `q_norm`) and its heads (`wq_b`, a weightless RMSNorm per head), one key that
is also the value (`wkv`, `norm`), the last `rotary_dim` channels of both rotated (moe_runtime/layers/v4_rotary.py).
Each head's softmax runs over [window keys; chosen entries; its sink logit] (`attn_sink`, gpt-oss's sink: it adds
to the denominator only), scaled by 1/sqrt(head_dim). The output's rotary channels are rotated back by the query's
position (so a value's contribution depends on its distance only), then the grouped low-rank output projection:
head group g's channels through its own block of `wo_a` ([o_groups * o_lora_rank, heads * head_dim / o_groups]),
then `wo_b`.

Caching (moe_runtime/layers/compressed_cache.py): the window's keys and the compressors' projections of positions
not yet in a complete entry are per-sequence state; the entries are paged. Each step runs sequence by sequence:
it compresses the windows its new tokens complete and stores those entries, then attends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.compressed_cache import CompressedAttentionSpec, LayerCompressedCache, read_ring, write_ring
from moe_runtime.layers.kv_compressor import KVCompressor, WeightedNorm
from moe_runtime.layers.linear import Linear, LinearShard
from moe_runtime.layers.norm import weightless_rms_norm
from moe_runtime.layers.v4_indexer import IndexQueries, V4Indexer
from moe_runtime.layers.v4_rotary import V4Rotary
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked


@dataclass(frozen=True)
class V4AttentionShape:
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_rate: int      # 0: sliding only
    overlapping: bool       # CSA
    eps: float
    draft_slack: int = 0    # ring positions beyond what a step reads (speculative decoding's drafts)


@dataclass
class StepProjections:
    """What a step's new tokens bring to one layer, before attention."""

    queries: torch.Tensor                 # [T, heads, D]
    keys: torch.Tensor                    # [T, D] (also the values)
    series: torch.Tensor | None           # [T, 2 * width]: the compressor's kv | gate
    index_series: torch.Tensor | None     # [T, 2 * index width]
    index_queries: IndexQueries | None


class CompressedAttention(nn.Module):
    def __init__(self, shape: V4AttentionShape, rotary: V4Rotary, compress_rotary: V4Rotary,
                 indexer: V4Indexer | None, dtype, device, quant=None, tp_size: int = 1, tp_rank: int = 0,
                 tp_group=None):
        """Under attention TP (`tp_size` ranks) a rank keeps heads [r * h / tp, (r + 1) * h / tp), which are whole
        output groups (`o_groups % tp_size == 0`: ParallelLayout refuses otherwise): its rows of `wq_b`, `wo_a` and
        the sinks, its columns of `wo_b` (partial outputs, summed over the group). The key, the compressors and the
        indexer are computed whole on every rank, so each keeps the same cache."""
        super().__init__()
        s = self.shape = shape
        self.tp_size, self.tp_group = tp_size, tp_group
        self.num_heads, self.o_groups = s.num_heads // tp_size, s.o_groups // tp_size   # this rank's
        first_head, first_group = tp_rank * self.num_heads, tp_rank * self.o_groups
        self.head_range = (first_head, first_head + self.num_heads)
        split = tp_size > 1
        hd, rank = s.head_dim, s.o_lora_rank
        self.wq_a = Linear(s.hidden_size, s.q_lora_rank, False, dtype, device, quant=quant)
        self.q_norm = WeightedNorm(s.q_lora_rank, s.eps, device)
        self.wq_b = Linear(s.q_lora_rank, s.num_heads * hd, False, dtype, device, quant=quant,
                           shard=LinearShard(0, first_head * hd, (first_head + self.num_heads) * hd) if split else None)
        self.wkv = Linear(s.hidden_size, hd, False, dtype, device, quant=quant)
        self.norm = WeightedNorm(hd, s.eps, device)
        group_rows = LinearShard(0, first_group * rank, (first_group + self.o_groups) * rank) if split else None
        group_cols = LinearShard(1, first_group * rank, (first_group + self.o_groups) * rank) if split else None
        self.wo_a = Linear(s.num_heads * hd // s.o_groups, s.o_groups * rank, False, dtype, device,
                           shard=group_rows)                                                # [g * r, in per group]
        self.wo_b = Linear(s.o_groups * rank, s.hidden_size, False, dtype, device, quant=quant, shard=group_cols)
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device),
                                      requires_grad=False)
        self.compressor = None
        if s.compress_rate:
            self.compressor = KVCompressor(s.hidden_size, s.head_dim, s.compress_rate, s.overlapping, s.eps,
                                           compress_rotary, dtype, device, quant)
        self.indexer = indexer
        self.rotary = rotary

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """This rank's heads' sinks (the projections load themselves, their shards)."""
        name = f"{prefix}attn_sink"
        copy_checked(self.attn_sink, reader.read(name)[self.head_range[0]:self.head_range[1]], name, reader.directory)
        return {"attn_sink"}

    def kv_cache_spec(self) -> CompressedAttentionSpec:
        s = self.shape
        index_dim = self.indexer.shape.head_dim if self.indexer is not None else 0
        return CompressedAttentionSpec(s.head_dim, s.window, s.compress_rate, s.overlapping, index_dim, s.draft_slack)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch,
                cache: LayerCompressedCache) -> torch.Tensor:   # [T, H] -> [T, H]
        s = self.shape
        step = self._project(positions, x)
        out = torch.zeros_like(step.queries)                                                  # [T, heads, D]
        for seq in range(batch.num_seqs):
            start, count = batch.query_start[seq], batch.query_lens[seq]
            if count:
                out[start:start + count] = self._sequence(seq, batch, cache, step, positions[start:start + count])
        out = self.rotary.rotate(out, positions, inverse=True)
        group_width = s.num_heads * s.head_dim // s.o_groups
        groups = out.reshape(x.shape[0], self.o_groups, group_width).transpose(0, 1)       # [g, T, in per group]
        weight = self.wo_a.weight.view(self.o_groups, s.o_lora_rank, group_width)            # [g, r, in per group]
        grouped = torch.bmm(groups, weight.transpose(1, 2)).transpose(0, 1)                 # [T, g, r]
        out = self.wo_b(grouped.reshape(x.shape[0], self.o_groups * s.o_lora_rank))
        return self.wo_b.reduce(out, self.tp_group) if self.tp_size > 1 else out

    def _project(self, positions: torch.Tensor, x: torch.Tensor) -> StepProjections:
        s = self.shape
        q_latent = self.q_norm(self.wq_a(x))                                                 # [T, q_lora]
        q = weightless_rms_norm(self.wq_b(q_latent).view(x.shape[0], self.num_heads, s.head_dim), s.eps)
        keys = self.rotary.rotate(self.norm(self.wkv(x))[:, None, :], positions)[:, 0, :]   # [T, D]
        series = None if self.compressor is None else self.compressor.project(x)
        index_series = index_queries = None
        if self.indexer is not None:
            index_series = self.indexer.compressor.project(x)
            index_queries = self.indexer.queries(positions, x, q_latent)
        return StepProjections(self.rotary.rotate(q, positions), keys, series, index_series, index_queries)

    def _sequence(self, seq: int, batch: AttentionBatch, cache: LayerCompressedCache, step: StepProjections,
                  positions: torch.Tensor) -> torch.Tensor:   # -> [n, heads, D]
        s = self.shape
        start, count = batch.query_start[seq], batch.query_lens[seq]
        rows = slice(start, start + count)
        first = batch.context_lens[seq] - count                      # the first new position
        slot = batch.state_slots[seq]
        window_first = max(first - s.window + 1, 0)
        keys = torch.cat([read_ring(cache.window, slot, window_first, first), step.keys[rows]])   # [L, D]
        key_positions = torch.arange(window_first, first + count, device=keys.device)
        visible = ((key_positions[None, :] <= positions[:, None])
                   & (key_positions[None, :] > positions[:, None] - s.window))                 # [n, L]
        self._save_window(cache, slot, step.keys[rows], first)
        if self.compressor is not None:
            table = batch.block_tables[seq]
            entries = self._compressed(cache, cache.entries, cache.carry, self.compressor, step.series[rows],
                                       table, slot, first)
            ready = torch.arange(entries.shape[0], device=keys.device)[None, :] < (
                (positions + 1) // s.compress_rate)[:, None]                                  # [n, E]
            if self.indexer is not None:
                index_keys = self._compressed(cache, cache.index_keys, cache.index_carry, self.indexer.compressor,
                                              step.index_series[rows], table, slot, first)
                ready = self.indexer.choose(step.index_queries.rows(start, start + count), index_keys, positions,
                                            batch.index_row_widths(seq))
            keys = torch.cat([keys, entries])
            visible = torch.cat([visible, ready], dim=1)
        return self._attend(step.queries[rows], keys, visible)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax with sinks over the visible keys (also the values): q [n, h, D], keys [L, D], visible [n, L]."""
        logits = torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * self.shape.head_dim ** -0.5
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = self.attn_sink.float()[None, :, None].expand(q.shape[0], -1, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]                 # [n, h, L]
        return torch.einsum("nhl,ld->nhd", probs, keys.float()).to(q.dtype)

    def _save_window(self, cache: LayerCompressedCache, slot: int, keys: torch.Tensor, first: int) -> None:
        """The window ring after this step (and after each captured boundary, into its snapshot row)."""
        for tokens, row in cache.captures.get(slot, ()):
            cache.window[row].copy_(cache.window[slot])
            write_ring(cache.window, row, keys[:tokens], first)
        write_ring(cache.window, slot, keys, first)

    def _compressed(self, cache: LayerCompressedCache, paged: torch.Tensor, carry: torch.Tensor,
                    compressor: KVCompressor, series: torch.Tensor, table: torch.Tensor, slot: int,
                    first: int) -> torch.Tensor:   # -> [entries so far, D]
        """Compress the windows this step completes into `paged`, carry the projections a later step needs, and
        return every entry of the sequence so far."""
        rate, carried = compressor.rate, (2 if compressor.overlapping else 1) * compressor.rate
        stop = first + series.shape[0]
        series_start = max(first - carried + 1, 0)   # what the windows not yet compressed mix
        full = torch.cat([read_ring(carry, slot, series_start, first), series])             # [stop - start, W]
        done, total = first // rate, stop // rate
        flat = paged.view(-1, paged.shape[-1])
        if total > done:
            new = compressor.compress(full, series_start, done, total)                     # [total - done, D]
            flat.index_copy_(0, cache.entry_slots(table, done, total), new.to(flat.dtype))
        for tokens, row in cache.captures.get(slot, ()):
            carry[row].copy_(carry[slot])
            write_ring(carry, row, series[:tokens], first)
        write_ring(carry, slot, series, first)
        return flat.index_select(0, cache.entry_slots(table, 0, total))
