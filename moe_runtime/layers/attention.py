"""Multi-head / grouped-query attention over the paged KV cache (Llama, Qwen, Mixtral, OLMoE).

With attention tensor parallelism (a DP attention worker spanning several ranks) each rank holds
a slice of the heads: q/k/v are column parallel, o_proj row parallel with one all-reduce. When
there are fewer KV heads than ranks, KV heads are replicated (rank r uses head r // (tp / Hkv)).

Attention variants a model declares in its `AttentionShape`: `span` (full, `AttentionSpan(SLIDING, W)`,
`AttentionSpan(CHUNKED, C)`; `sliding_window=W` is the same as the sliding span) and `sinks` (gpt-oss: one
learned logit per query head in every row's softmax denominator, the checkpoint's `self_attn.sinks`, this
rank's heads under attention TP). Llama 4 adds three: layers without rotary (NoPE: `rotary=None`), a
weightless per-head q/k norm taken after the rotary (`qk_norm="l2"`), and queries scaled by a function of
their position (`query_temperature`, moe_runtime/layers/query_temperature.py); all three are per head and
per row, so they need nothing under attention TP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention, varlen_causal_attention
from moe_runtime.layers.attention_span import SLIDING, AttentionSpan
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Linear, LinearShard
from moe_runtime.layers.norm import RMSNorm, weightless_rms_norm
from moe_runtime.layers.query_temperature import QueryTemperature
from moe_runtime.layers.rotary import RotaryEmbedding
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None        # None | "per_head" (Qwen3) | "full" (OLMoE: over the whole projection)
    #                                   | "l2" (Llama 4: per head, no weight, after the rotary)
    norm_eps: float = 1e-6
    clip_qkv: float | None = None
    sliding_window: int | None = None   # the same as span=AttentionSpan(SLIDING, W): either may be given
    span: AttentionSpan | None = None   # which keys a query reads (None: from sliding_window, else full)
    sinks: bool = False                 # a learned sink logit per query head (gpt-oss)
    query_temperature: QueryTemperature | None = None   # queries scaled by their position (Llama 4's NoPE layers)
    input_size: int | None = None       # q/k/v's input width (None: hidden_size; an EAGLE-3 head's is 2 x hidden)

    def __post_init__(self):
        """Make `span` and `sliding_window` say the same thing, whichever was given."""
        window_span = AttentionSpan(SLIDING, self.sliding_window) if self.sliding_window else AttentionSpan()
        if self.span is None:
            object.__setattr__(self, "span", window_span)
        elif self.sliding_window and self.span != window_span:
            raise ValueError(f"sliding_window={self.sliding_window} contradicts span {self.span}")
        elif self.span.kind == SLIDING:
            object.__setattr__(self, "sliding_window", self.span.size)


@dataclass(frozen=True)
class HeadShard:
    """The heads one attention-TP rank holds."""

    tp_size: int
    tp_rank: int
    num_heads: int       # local query heads
    num_kv_heads: int    # local KV heads
    q_start: int         # first local query head
    kv_start: int        # first local KV head

    @classmethod
    def of(cls, shape: AttentionShape, tp_size: int, tp_rank: int) -> "HeadShard":
        heads = shape.num_heads // tp_size
        if shape.num_kv_heads >= tp_size:
            kv_heads = shape.num_kv_heads // tp_size
            kv_start = tp_rank * kv_heads
        else:  # replicate: tp_size // num_kv_heads ranks share each KV head
            kv_heads = 1
            kv_start = tp_rank // (tp_size // shape.num_kv_heads)
        return cls(tp_size, tp_rank, heads, kv_heads, tp_rank * heads, kv_start)

    def rows(self, start_head: int, num_heads: int, head_dim: int) -> LinearShard | None:
        if self.tp_size == 1:
            return None
        return LinearShard(0, start_head * head_dim, (start_head + num_heads) * head_dim)


class TensorParallelRMSNorm(nn.Module):
    """RMSNorm over a dimension split across TP ranks (OLMoE's q/k norm): the variance is all-reduced."""

    def __init__(self, full_dim: int, start: int, stop: int, eps: float, group, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(stop - start, dtype=dtype, device=device), requires_grad=False)
        self.full_dim, self.start, self.stop, self.eps, self.group = full_dim, start, stop, eps, group

    def load_weights(self, reader, prefix: str) -> set[str]:
        from moe_runtime.weights.loading import copy_checked

        copy_checked(self.weight, reader.read(f"{prefix}weight")[self.start : self.stop], f"{prefix}weight",
                     reader.directory)
        return {"weight"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local_dim]
        x32 = x.float()
        square_sum = x32.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(square_sum, group=self.group)
        normed = x32 * torch.rsqrt(square_sum / self.full_dim + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: AttentionShape, rotary: RotaryEmbedding | None, kernels, dtype, device=None,
                 tp_size: int = 1, tp_rank: int = 0, tp_group=None, quant: WeightQuantization | None = None):
        super().__init__()
        s = shape
        self.shape = s
        self.heads = h = HeadShard.of(s, tp_size, tp_rank)
        self.tp_group = tp_group
        d = s.head_dim
        width = s.input_size or s.hidden_size
        self.q_proj = Linear(width, s.num_heads * d, s.qkv_bias, dtype, device, h.rows(h.q_start, h.num_heads, d), quant)
        kv_rows = h.rows(h.kv_start, h.num_kv_heads, d)
        self.k_proj = Linear(width, s.num_kv_heads * d, s.qkv_bias, dtype, device, kv_rows, quant)
        self.v_proj = Linear(width, s.num_kv_heads * d, s.qkv_bias, dtype, device, kv_rows, quant)
        o_cols = None if tp_size == 1 else LinearShard(1, h.q_start * d, (h.q_start + h.num_heads) * d)
        self.o_proj = Linear(s.num_heads * d, s.hidden_size, s.o_bias, dtype, device, o_cols, quant)
        if s.qk_norm == "per_head":
            self.q_norm = RMSNorm(d, s.norm_eps, kernels, dtype, device)
            self.k_norm = RMSNorm(d, s.norm_eps, kernels, dtype, device)
        elif s.qk_norm == "full" and tp_size == 1:
            self.q_norm = RMSNorm(s.num_heads * d, s.norm_eps, kernels, dtype, device)
            self.k_norm = RMSNorm(s.num_kv_heads * d, s.norm_eps, kernels, dtype, device)
        elif s.qk_norm == "full":
            if s.num_kv_heads < tp_size:
                raise ValueError("a q/k norm over the whole projection needs at least one KV head per TP rank")
            self.q_norm = TensorParallelRMSNorm(s.num_heads * d, h.q_start * d, (h.q_start + h.num_heads) * d,
                                                s.norm_eps, tp_group, dtype, device)
            self.k_norm = TensorParallelRMSNorm(s.num_kv_heads * d, h.kv_start * d,
                                                (h.kv_start + h.num_kv_heads) * d, s.norm_eps, tp_group, dtype, device)
        self.rotary = rotary   # None: no position embedding (Llama 4's NoPE layers)
        self.scale = d ** -0.5
        # [local Hq] fp32: the kernels add it to the scaled scores' softmax in fp32
        self.sinks = nn.Parameter(torch.zeros(h.num_heads, dtype=torch.float32, device=device),
                                  requires_grad=False) if s.sinks else None
        self._attention = attention_kernels_for(kernels, torch.device(device if device is not None else "cpu"))

    def load_weights(self, reader, prefix: str) -> set[str]:
        """This rank's slice of the sinks (the projections load themselves)."""
        if self.sinks is None:
            return set()
        from moe_runtime.weights.loading import copy_checked

        h = self.heads
        copy_checked(self.sinks, reader.read(f"{prefix}sinks")[h.q_start : h.q_start + h.num_heads], f"{prefix}sinks",
                     reader.directory)
        return {"sinks"}

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.heads.num_kv_heads, self.shape.head_dim, self.shape.head_dim, self.heads.kv_start,
                           self.shape.num_kv_heads, self.shape.span)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache):
        s, h = self.shape, self.heads
        batch = batch.for_group(cache.group)   # a windowed layer's own block tables and slots
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, hq*D], [T, hkv*D], [T, hkv*D]
        if s.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, h.num_heads, s.head_dim)
        k = k.view(num_tokens, h.num_kv_heads, s.head_dim)
        v = v.view(num_tokens, h.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if s.qk_norm == "l2":
            q, k = weightless_rms_norm(q, s.norm_eps), weightless_rms_norm(k, s.norm_eps)
        if s.query_temperature is not None:
            q = s.query_temperature.apply(positions, q)
        batch.write_kv(cache, k, v)
        if num_tokens == 0:
            out = q.new_zeros(0, h.num_heads, s.head_dim)
        else:
            span, sinks = s.span, self.sinks

            def single(rows, block_tables, context_lens, key_starts=None):   # one new token per sequence: paged
                return self._attention.decode(q if rows is None else q[rows], cache.keys, cache.values, block_tables,
                                              context_lens, self.scale, key_starts=key_starts, sinks=sinks)

            def varlen(seqs):                                # prefills and chunks, with their cached context
                if self._attention.prefill is not None:      # one varlen launch over the paged cache (GPU)
                    return paged_varlen_attention(q, batch, self._attention.prefill, cache.keys, cache.values,
                                                  self.scale, span, seqs, sinks=sinks)
                return varlen_causal_attention(q, batch, lambda seq: cache.gather(batch.context_slots(seq)),
                                               self.scale, span, seqs, sinks)

            out = split_attention(batch, span, single, varlen)   # [T, hq, D]
        out = self.o_proj(out.reshape(num_tokens, h.num_heads * s.head_dim))
        if h.tp_size > 1:
            out = self.o_proj.reduce(out, self.tp_group)
        return out
