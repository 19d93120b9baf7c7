"""Multi-head / grouped-query attention over the paged KV cache (Llama, Qwen, Mixtral, OLMoE)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.attention_batch import AttentionBatch
from moe_runtime.layers.attention_ops import varlen_causal_attention, window_exceeded
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Linear
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None        # None | "per_head" (Qwen3) | "full" (OLMoE: over the whole projection)
    norm_eps: float = 1e-6
    clip_qkv: float | None = None
    sliding_window: int | None = None


class Attention(nn.Module):
    def __init__(self, shape: AttentionShape, rotary: RotaryEmbedding, kernels, dtype, device=None):
        super().__init__()
        s = shape
        self.shape = s
        self.q_proj = Linear(s.hidden_size, s.num_heads * s.head_dim, s.qkv_bias, dtype, device)
        self.k_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, s.qkv_bias, dtype, device)
        self.v_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, s.qkv_bias, dtype, device)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, s.o_bias, dtype, device)
        if s.qk_norm == "per_head":
            self.q_norm = RMSNorm(s.head_dim, s.norm_eps, kernels, dtype, device)
            self.k_norm = RMSNorm(s.head_dim, s.norm_eps, kernels, dtype, device)
        elif s.qk_norm == "full":
            self.q_norm = RMSNorm(s.num_heads * s.head_dim, s.norm_eps, kernels, dtype, device)
            self.k_norm = RMSNorm(s.num_kv_heads * s.head_dim, s.norm_eps, kernels, dtype, device)
        self.rotary = rotary
        self.scale = s.head_dim ** -0.5
        self._kernels = kernels

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.shape.num_kv_heads, self.shape.head_dim, self.shape.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache):
        s = self.shape
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        if s.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, s.num_heads, s.head_dim)
        k = k.view(num_tokens, s.num_kv_heads, s.head_dim)
        v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        cache.write(batch.slot_mapping, k, v)
        if num_tokens == 0:
            out = q.new_zeros(0, s.num_heads, s.head_dim)
        elif batch.is_decode and not window_exceeded(batch, s.sliding_window):
            out = self._kernels.paged_decode_attention(
                q, cache.keys, cache.values, batch.block_tables, batch.context_lens_tensor, self.scale
            )
        else:
            out = varlen_causal_attention(
                q, batch, lambda seq: cache.gather(batch.context_slots(seq)), self.scale, s.sliding_window
            )
        return self.o_proj(out.reshape(num_tokens, s.num_heads * s.head_dim))
