"""The full attention of Qwen3-Next and Qwen3.5-MoE: GQA over the paged KV cache with an output gate.

`q_proj` gives, per query head, the query and a gate of the same width ([head: q_h, gate_h] rows, so an
attention-TP rank's heads are one contiguous row range); the attention output is multiplied by sigmoid(gate)
before `o_proj`. The q/k norms are per head and scale by (1 + weight) (`OffsetRMSNorm`), and the rotary covers
only the leading channels of each head (partial_rotary_factor, 0.25 in the published configs). For text the
Qwen3.5 multimodal rotary reduces to this one: its three position streams are equal.
"""
from __future__ import annotations

import torch

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention, varlen_causal_attention
from moe_runtime.layers.hybrid_norms import OffsetRMSNorm
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.layers.linear import Linear


class GatedAttention(Attention):
    def __init__(self, shape: AttentionShape, rotary, kernels, dtype, device=None, tp_size: int = 1, tp_rank: int = 0,
                 tp_group=None):
        if shape.qk_norm is not None or shape.sinks or shape.span.windowed:
            raise ValueError("gated attention takes its own (1 + weight) q/k norm and no sinks or window")
        super().__init__(shape, rotary, kernels, dtype, device, tp_size, tp_rank, tp_group)
        h, d = self.heads, shape.head_dim
        rows = h.rows(h.q_start, h.num_heads, 2 * d)   # query and gate rows of this rank's heads
        self.q_proj = Linear(shape.hidden_size, shape.num_heads * 2 * d, shape.qkv_bias, dtype, device, rows)
        self.q_norm = OffsetRMSNorm(d, shape.norm_eps, dtype, device)
        self.k_norm = OffsetRMSNorm(d, shape.norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache):
        s, h, d = self.shape, self.heads, self.shape.head_dim
        num_tokens = x.shape[0]
        q, gate = self.q_proj(x).view(num_tokens, h.num_heads, 2 * d).split([d, d], dim=-1)   # [T, hq, D] each
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(num_tokens, h.num_kv_heads, d))
        v = self.v_proj(x).view(num_tokens, h.num_kv_heads, d)
        q, k = self.rotary(positions, q, k)
        batch.write_kv(cache, k, v)
        out = self._attend(q, batch, cache) if num_tokens else q.new_zeros(0, h.num_heads, d)   # [T, hq, D]
        out = self.o_proj((out * torch.sigmoid(gate)).reshape(num_tokens, h.num_heads * d))
        return self.o_proj.reduce(out, self.tp_group) if h.tp_size > 1 else out

    def _attend(self, q: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:
        """Decodes through the paged decode kernel, prefills and chunks through the varlen path (full span)."""
        span = self.shape.span

        def single(rows, block_tables, context_lens, key_starts=None):
            return self._attention.decode(q if rows is None else q[rows], cache.keys, cache.values, block_tables,
                                          context_lens, self.scale, key_starts=key_starts)

        def varlen(seqs):
            if self._attention.prefill is not None:
                return paged_varlen_attention(q, batch, self._attention.prefill, cache.keys, cache.values, self.scale,
                                              span, seqs)
            return varlen_causal_attention(q, batch, lambda seq: cache.gather(batch.context_slots(seq)), self.scale,
                                           span, seqs)

        return split_attention(batch, span, single, varlen)
