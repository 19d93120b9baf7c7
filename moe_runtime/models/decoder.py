"""The decoder stack every architecture assembles: embed -> layers (attention + MLP) -> norm -> LM head.

Parameter names follow the HF checkpoints (model.layers.N.self_attn.q_proj.weight, ...), so weights
load by name; model files only choose which attention and MLP each layer gets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import KVCacheSpec, LayerKVCache
from moe_runtime.layers.linear import Embedding, Linear
from moe_runtime.layers.norm import RMSNorm
from moe_runtime.parallel_context import ParallelContext


@dataclass
class BuildContext:
    """What model builders need besides the HF config: where and how layers run."""

    kernels: object
    executor: object
    parallel: ParallelContext
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, ctx: BuildContext,
                 mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device)

    def forward(self, positions, x, batch: AttentionBatch, cache: LayerKVCache) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch, cache)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: list[DecoderLayer], eps: float, ctx: BuildContext):
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden_size, ctx.dtype, ctx.device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps, ctx.kernels, ctx.dtype, ctx.device)


class CausalLM(nn.Module):
    """`forward` maps a flattened batch of new tokens to final hidden states; `logits` projects them."""

    def __init__(self, hf_config, stack: DecoderStack, tie_word_embeddings: bool, ctx: BuildContext):
        super().__init__()
        self.hf_config = hf_config
        self.model = stack
        self.lm_head = None
        if not tie_word_embeddings:
            vocab, hidden = stack.embed_tokens.weight.shape
            self.lm_head = Linear(hidden, vocab, False, ctx.dtype, ctx.device)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec() for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                caches: list[LayerKVCache]) -> torch.Tensor:  # [T] -> [T, H]
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(positions, x, batch, cache)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
