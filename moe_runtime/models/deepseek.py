"""DeepSeek-V2 / V3: MLA attention, grouped top-k routing, shared experts, first-k dense layers."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_runtime.kernels import RoutingConfig
from moe_runtime.layers.mla import MLAShape, MultiHeadLatentAttention, mla_softmax_scale
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.models.common import rotary_for
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack


def deepseek_v2_routing(cfg) -> RoutingConfig:
    """transformers' V2 router: softmax, optional group-limited greedy (group max), always scaled, no renorm."""
    grouped = cfg.topk_method == "group_limited_greedy"
    return RoutingConfig(
        top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=False,
        num_groups=cfg.n_group if grouped else 1, topk_groups=cfg.topk_group if grouped else 1,
        group_score="max", routed_scaling_factor=cfg.routed_scaling_factor,
    )


def deepseek_v3_routing(cfg) -> RoutingConfig:
    return RoutingConfig(
        top_k=cfg.num_experts_per_tok, scoring="sigmoid", renormalize=bool(cfg.norm_topk_prob),
        num_groups=cfg.n_group or 1, topk_groups=cfg.topk_group or 1, group_score="top2_sum",
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


def mla_shape(cfg) -> MLAShape:
    return MLAShape(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
    )


def mla_arguments(cfg, ctx: BuildContext, interleaved_rope: bool) -> dict:
    """What every MLA layer of the model is built with (`MultiHeadLatentAttention`'s arguments)."""
    shape = mla_shape(cfg)
    p = ctx.parallel
    return dict(shape=shape, rotary=rotary_for(cfg, cfg.qk_rope_head_dim, ctx.device, interleaved_rope),
                scale=mla_softmax_scale(cfg, shape.qk_head_dim), kernels=ctx.kernels, dtype=ctx.dtype,
                device=ctx.device, tp_size=p.attn_tp_size, tp_rank=p.attn_tp_rank, tp_group=p.attn_tp_group,
                quant=ctx.linear_quant)


def is_dense_layer(cfg, i: int) -> bool:
    """The first `first_k_dense_replace` layers, or those `mlp_layer_types` calls dense where the config has it
    (a multi-token-prediction layer past the last one is an MoE layer)."""
    kinds = getattr(cfg, "mlp_layer_types", None)
    if kinds is not None:
        return i < len(kinds) and kinds[i] == "dense"
    return i < (cfg.first_k_dense_replace or 0)


@dataclass(frozen=True)
class DeepseekLayout:
    """What distinguishes the DeepSeek versions' decoder layers."""

    routing: RoutingConfig
    correction_bias: bool          # V3: a per-expert bias added to the scores for choosing experts
    interleaved_rope: bool

    @classmethod
    def v2(cls, cfg) -> "DeepseekLayout":
        return cls(deepseek_v2_routing(cfg), correction_bias=False, interleaved_rope=True)

    @classmethod
    def v3(cls, cfg) -> "DeepseekLayout":
        return cls(deepseek_v3_routing(cfg), correction_bias=True,
                   interleaved_rope=bool(getattr(cfg, "rope_interleave", True)))


@dataclass
class LayerParts:
    attention: nn.Module           # MultiHeadLatentAttention (DeepSeek), GQA attention (GLM-4.5)
    mlp: nn.Module                 # SparseMoE from first_k_dense_replace on, a dense MLP before


def deepseek_mlp(cfg, ctx: BuildContext, routing: RoutingConfig, correction_bias: bool, index: int) -> nn.Module:
    """Layer `index`'s MLP: dense (`is_dense_layer`) or routed experts with the shared ones."""
    if is_dense_layer(cfg, index):
        return ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size)
    moe_shape = MoEShape(
        cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size,
        shared_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
        shared_name="shared_experts", correction_bias=correction_bias,
    )
    return SparseMoE(moe_shape, routing, ctx.executor, ctx.kernels, dtype=ctx.dtype, device=ctx.device,
                     quant=ctx.quant)


def deepseek_layer_parts(cfg, ctx: BuildContext, layout: DeepseekLayout, index: int) -> LayerParts:
    """Decoder layer `index`'s attention and MLP (also the multi-token-prediction layers' block, past the last)."""
    return LayerParts(MultiHeadLatentAttention(**mla_arguments(cfg, ctx, layout.interleaved_rope)),
                      deepseek_mlp(cfg, ctx, layout.routing, layout.correction_bias, index))


def build_mla_model(cfg, ctx: BuildContext, routing: RoutingConfig, make_attention, *,
                    correction_bias: bool) -> CausalLM:
    """A DeepSeek-style stack: `make_attention(i)` for layer i's attention, shared experts, dense first layers."""
    def make_layer(i: int) -> DecoderLayer:
        return DecoderLayer(make_attention(i), deepseek_mlp(cfg, ctx, routing, correction_bias, i),
                            cfg.hidden_size, cfg.rms_norm_eps, ctx)

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)


def _build(cfg, ctx: BuildContext, layout: DeepseekLayout) -> CausalLM:
    def make_attention(i: int) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(**mla_arguments(cfg, ctx, layout.interleaved_rope))

    return build_mla_model(cfg, ctx, layout.routing, make_attention, correction_bias=layout.correction_bias)


def build_deepseek_v2(cfg, ctx: BuildContext) -> CausalLM:
    return _build(cfg, ctx, DeepseekLayout.v2(cfg))


def build_deepseek_v3(cfg, ctx: BuildContext) -> CausalLM:
    return _build(cfg, ctx, DeepseekLayout.v3(cfg))
