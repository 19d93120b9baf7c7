"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`): hybrid Gated DeltaNet + gated full
attention, MoE with a sigmoid-gated shared expert.

layer_types says which layers mix tokens with Gated DeltaNet (`linear_attn`, moe_runtime/layers/gated_deltanet.py:
a recurrent state per sequence in the state cache group, moe_runtime/kv_blocks/state_slots.py) and which with gated
full attention (`self_attn`, moe_runtime/layers/gated_attention.py: the paged KV cache, group 0); the published
pattern is three linear to one full. Every RMSNorm of the decoder scales by (1 + weight) (`OffsetRMSNorm`).
The two differ only in the linear layers' projection layout (Qwen3-Next fuses them per key head) and in routing
(Qwen3.5 always renormalises the top-k; Qwen3-Next by norm_topk_prob) and dense layers (Qwen3-Next's
mlp_only_layers; Qwen3.5 has none). For text, Qwen3.5's multimodal rotary is the plain partial one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.kernels import RoutingConfig
from moe_runtime.kv_blocks.state_slots import LINEAR_ATTENTION
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention import AttentionShape
from moe_runtime.layers.gated_attention import GatedAttention
from moe_runtime.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from moe_runtime.layers.hybrid_norms import OffsetRMSNorm
from moe_runtime.layers.partial_rotary import partial_rotary_dim
from moe_runtime.models.common import head_dim_of, partial_rotary_for, rotary_for
from moe_runtime.models.decoder import BuildContext, CausalLM, build_stack
from moe_runtime.models.qwen_moe import is_sparse_layer
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.moe.stages import Staged, call_staged


class HybridDecoderLayer(nn.Module):
    """A decoder layer whose token mixer is named as the checkpoint names it (`linear_attn` or `self_attn`)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 ctx: BuildContext):
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps, ctx.dtype, ctx.device)
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps, ctx.dtype, ctx.device)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def cache_spec(self):
        """A linear layer's state slot shape, or a full layer's KV cache spec."""
        mixer = self.mixer
        return mixer.state_spec() if isinstance(mixer, GatedDeltaNet) else mixer.kv_cache_spec()

    def forward(self, positions, x, batch: AttentionBatch, cache) -> torch.Tensor:  # [T, H]
        x = x + self.mixer(positions, self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def stages(self, positions, x, batch: AttentionBatch, cache) -> Staged[torch.Tensor]:  # [T, H]
        x = x + self.mixer(positions, self.input_layernorm(x), batch, cache)
        mlp_out = yield from call_staged(self.mlp, self.post_attention_layernorm(x))
        return x + mlp_out


class HybridCausalLM(CausalLM):
    """Its layers' caches are KV caches (full attention) and state slots (linear attention), in layer order."""

    def kv_cache_specs(self) -> list:
        return [layer.cache_spec() for layer in self.model.owned_layers()]

    def min_sliding_window(self) -> int | None:
        return None


def _gated_attention(cfg, ctx: BuildContext) -> GatedAttention:
    head_dim = head_dim_of(cfg)
    shape = AttentionShape(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                           num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                           qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                           o_bias=bool(getattr(cfg, "attention_bias", False)), norm_eps=cfg.rms_norm_eps)
    rotary_dim = partial_rotary_dim(cfg, head_dim)
    rotary = (partial_rotary_for(cfg, rotary_dim, ctx.device) if rotary_dim < head_dim
              else rotary_for(cfg, head_dim, ctx.device))
    p = ctx.parallel
    return GatedAttention(shape, rotary, ctx.kernels, ctx.dtype, ctx.device, p.attn_tp_size, p.attn_tp_rank,
                          p.attn_tp_group)


@dataclass(frozen=True)
class HybridLayerFactory:
    """How the family's decoder layers are built (also the multi-token-prediction block's: moe_runtime/models/
    qwen3_next_mtp.py)."""

    cfg: object
    ctx: BuildContext
    fused_projections: bool   # Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's four projections)
    renormalize: bool         # the top-k weights renormalised

    def layer(self, index: int, layer_type: str) -> HybridDecoderLayer:
        cfg, ctx, p = self.cfg, self.ctx, self.ctx.parallel
        if is_sparse_layer(cfg, index):
            routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=self.renormalize)
            shape = MoEShape(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                             shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
                             shared_name="shared_expert")
            mlp = SparseMoE(shape, routing, ctx.executor, ctx.kernels, dtype=ctx.dtype, device=ctx.device,
                            quant=ctx.quant)
        else:
            mlp = ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size)
        if layer_type == LINEAR_ATTENTION:
            mixer_name, mixer = "linear_attn", GatedDeltaNet(DeltaNetShape.from_config(cfg, self.fused_projections),
                                                             ctx.dtype, ctx.device, p.attn_tp_size, p.attn_tp_rank,
                                                             p.attn_tp_group)
        else:
            mixer_name, mixer = "self_attn", _gated_attention(cfg, ctx)
        return HybridDecoderLayer(mixer_name, mixer, mlp, cfg.hidden_size, cfg.rms_norm_eps, ctx)

    @classmethod
    def of(cls, architecture: str, cfg, ctx: BuildContext) -> "HybridLayerFactory":
        if architecture == "Qwen3NextForCausalLM":
            return cls(cfg, ctx, fused_projections=True, renormalize=bool(getattr(cfg, "norm_topk_prob", True)))
        return cls(cfg, ctx, fused_projections=False, renormalize=True)


def _build(factory: HybridLayerFactory) -> HybridCausalLM:
    cfg, ctx = factory.cfg, factory.ctx
    stack = build_stack(cfg, ctx, lambda i: factory.layer(i, cfg.layer_types[i]))
    if stack.norm is not None:
        stack.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.device)
    return HybridCausalLM(cfg, stack, cfg.tie_word_embeddings, ctx)


def build_qwen3_next(cfg, ctx: BuildContext) -> HybridCausalLM:
    return _build(HybridLayerFactory.of("Qwen3NextForCausalLM", cfg, ctx))


def build_qwen3_5_moe(cfg, ctx: BuildContext) -> HybridCausalLM:
    return _build(HybridLayerFactory.of("Qwen3_5MoeForCausalLM", cfg, ctx))
