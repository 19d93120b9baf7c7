"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The cache holds, per token, one "head" of [kv_lora_rank latent | qk_rope_head_dim rotated key].
Decode absorbs kv_b_proj into the query and the output (attention runs in the latent space, MQA with 1
KV head), the layout DeepSeek serves with. Prefill on the torch path expands the latents with kv_b_proj
(per-sequence SDPA over [S, heads, 192] keys); where the attention backend has a varlen kernel (Triton,
FlashInfer on a GPU) prefill is absorbed too: one launch over the paged latent cache for every chunk of the
step, prefix included, with no expansion of the cached context (at 128 heads the expansion writes 64 KiB
per context token and layer; the absorbed scores cost 576 + 512 instead of 192 + 128 multiply-adds per
query, key and head, which a long fresh prompt pays and a chunk over a long prefix saves).

Under `--deterministic` (the batch-invariant family) every path is absorbed: its attention backend has a varlen
kernel, the fixed-order one decode also runs, and the per-head W_UK / W_UV products take fixed-shape tiles
(`invariant_head_linear`), so a row's bits do not depend on the chunking, the prefix cache or the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT, invariant_head_linear
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention, varlen_causal_attention
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Linear, LinearShard
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.layers.rotary import RotaryEmbedding
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


@dataclass(frozen=True)
class MLAShape:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_softmax_scale(hf_config, qk_head_dim: int) -> float:
    """qk_head_dim**-0.5, times yarn's mscale**2 when the rope is scaled (as transformers does)."""
    scale = qk_head_dim ** -0.5
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, shape: MLAShape, rotary: RotaryEmbedding, scale: float, kernels, dtype, device=None,
                 tp_size: int = 1, tp_rank: int = 0, tp_group=None, quant: WeightQuantization | None = None):
        super().__init__()
        s = shape
        self.shape = s
        self.tp_size, self.tp_group = tp_size, tp_group
        self.num_heads = heads = s.num_heads // tp_size   # local heads; the latent cache is per rank, whole
        first = tp_rank * heads

        def head_rows(per_head: int) -> LinearShard | None:
            return None if tp_size == 1 else LinearShard(0, first * per_head, (first + heads) * per_head)

        if s.q_lora_rank is None:
            self.q_proj = Linear(s.hidden_size, s.num_heads * s.qk_head_dim, False, dtype, device,
                                 head_rows(s.qk_head_dim), quant)
        else:
            self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, s.attention_bias, dtype, device, quant=quant)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS, kernels, dtype, device)
            self.q_b_proj = Linear(s.q_lora_rank, s.num_heads * s.qk_head_dim, False, dtype, device,
                                   head_rows(s.qk_head_dim), quant)
        self.kv_a_proj_with_mqa = Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, s.attention_bias, dtype,
                                         device, quant=quant)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS, kernels, dtype, device)
        # kv_b_proj stays in the compute dtype even under --quantization fp8: decode absorbs it into the
        # queries and outputs as W_UK / W_UV (`_kv_b_split`), which reads the weight itself, not a matmul
        self.kv_b_proj = Linear(s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), False, dtype, device,
                                head_rows(s.qk_nope_head_dim + s.v_head_dim))
        o_cols = None if tp_size == 1 else LinearShard(1, first * s.v_head_dim, (first + heads) * s.v_head_dim)
        self.o_proj = Linear(s.num_heads * s.v_head_dim, s.hidden_size, s.attention_bias, dtype, device, o_cols, quant)
        self.rotary = rotary
        self.scale = scale
        self._attention = attention_kernels_for(kernels, torch.device(device if device is not None else "cpu"))
        self._fixed_order = kernels.name == BATCH_INVARIANT   # per-head products in fixed tiles (--deterministic)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, self.shape.kv_lora_rank + self.shape.qk_rope_head_dim, None)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, heads, qk_head_dim]
        s = self.shape
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, s.qk_head_dim)

    def _kv_b_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_UK [heads, nope, L] and W_UV [heads, v, L]."""
        s = self.shape
        w = self.kv_b_proj.weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache):
        s = self.shape
        num_tokens = x.shape[0]
        q = self._queries(x)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)  # [T, h, nope], [T, h, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)                                      # [T, L]
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None, :])               # [T, h, rope], [T, 1, rope]
        batch.write_kv(cache, torch.cat([latent[:, None, :], k_pe], dim=-1))
        if num_tokens == 0:
            out = x.new_zeros(0, self.num_heads, s.v_head_dim)
        else:
            def single(rows, block_tables, context_lens):   # one new token per sequence: absorbed, paged kernel
                if rows is not None:
                    return self._decode_absorbed(q_nope[rows], q_pe[rows], block_tables, context_lens, cache)
                return self._decode_absorbed(q_nope, q_pe, block_tables, context_lens, cache)

            def varlen(seqs):                                # prefills and chunks
                if self._attention.prefill is not None:      # absorbed, one varlen launch over the latent cache
                    return self._prefill_absorbed(q_nope, q_pe, batch, cache, seqs)
                return self._prefill_expanded(torch.cat([q_nope, q_pe], dim=-1), batch, cache, seqs)

            out = split_attention(batch, None, single, varlen)               # [T, h, v]
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * s.v_head_dim))
        if self.tp_size > 1:
            out = self.o_proj.reduce(out, self.tp_group)
        return out

    def _prefill_expanded(self, q: torch.Tensor, batch: AttentionBatch, cache: LayerKVCache,
                          seqs: list[int] | None = None) -> torch.Tensor:
        s = self.shape
        # Context-parallel pieces of one sequence share their context up to each piece's end: expand the
        # longest once and give the others its prefix (pieces of a sequence come one after another).
        longest: dict[int, int] = {}
        for seq in range(batch.num_seqs) if seqs is None else seqs:
            source = batch.source_seq(seq)
            if source not in longest or batch.context_lens[seq] > batch.context_lens[longest[source]]:
                longest[source] = seq
        expanded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def fetch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
            widest = longest[batch.source_seq(seq)]
            if widest not in expanded:
                expanded.clear()                                                  # the previous sequence's
                entries, _ = cache.gather(batch.context_slots(widest))            # [S, 1, L + rope]
                latent, k_pe = entries[:, 0].split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
                kv = self.kv_b_proj(latent).view(-1, self.num_heads, s.qk_nope_head_dim + s.v_head_dim)
                k_nope, values = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
                keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
                expanded[widest] = keys, values                                   # [S, h, qk], [S, h, v]
            keys, values = expanded[widest]
            length = batch.context_lens[seq]
            return keys[:length], values[:length]

        return varlen_causal_attention(q, batch, fetch, self.scale, seqs=seqs)

    def _absorbed(self, q_nope, q_pe, attend) -> torch.Tensor:   # q_nope [T, h, nope], q_pe [T, h, rope]
        """Attention in the latent space: W_UK folded into the queries, W_UV applied to the latent output.
        `attend(q_full [T, h, L + rope], latent_values [NB, BS, 1, L] view) -> [T, h, L]`."""
        return self._values_of_latent(attend(self._absorbed_queries(q_nope, q_pe)))

    def _absorbed_queries(self, q_nope, q_pe) -> torch.Tensor:   # [T, h, nope], [T, h, rope] -> [T, h, L + rope]
        """The queries in the latent space: W_UK folded into their no-rope part."""
        w_uk, _ = self._kv_b_split()
        if self._fixed_order:
            q_latent = invariant_head_linear(q_nope, w_uk)                        # [T, h, L]
        else:
            q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)                 # [T, h, L]
        return torch.cat([q_latent, q_pe], dim=-1)

    def _values_of_latent(self, out_latent: torch.Tensor) -> torch.Tensor:   # [T, h, L] -> [T, h, v]
        """Attention's output in the latent space mapped to the heads' values by W_UV."""
        _, w_uv = self._kv_b_split()
        if self._fixed_order:
            return invariant_head_linear(out_latent, w_uv.transpose(1, 2))       # [T, h, v]
        return torch.einsum("thl,hvl->thv", out_latent, w_uv)

    def _decode_absorbed(self, q_nope, q_pe, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cache: LayerKVCache) -> torch.Tensor:   # q_nope [S, h, nope], q_pe [S, h, rope]
        latent_values = cache.keys[..., : self.shape.kv_lora_rank]                # [NB, BS, 1, L] view
        return self._absorbed(q_nope, q_pe, lambda q_full: self._attention.decode(
            q_full, cache.keys, latent_values, block_tables, context_lens, self.scale))

    def _prefill_absorbed(self, q_nope, q_pe, batch: AttentionBatch, cache: LayerKVCache,
                          seqs: list[int] | None) -> torch.Tensor:   # q_nope [T, h, nope] -> [rows of seqs, h, v]
        rows, _ = batch.prefill_batch(seqs)
        if rows is not None:
            q_nope, q_pe = q_nope[rows], q_pe[rows]
        latent_values = cache.keys[..., : self.shape.kv_lora_rank]                # [NB, BS, 1, L] view
        return self._absorbed(q_nope, q_pe, lambda q_full: paged_varlen_attention(
            q_full, batch, self._attention.prefill, cache.keys, latent_values, self.scale, seqs=seqs,
            rows_selected=True))
