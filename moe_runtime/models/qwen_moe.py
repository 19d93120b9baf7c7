"""Qwen2-MoE (qkv bias, gated shared expert) and Qwen3-MoE (per-head q/k norm) and OLMoE (full q/k norm)."""
from __future__ import annotations

from moe_runtime.kernels import RoutingConfig
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.models.common import gqa_attention
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack


def is_sparse_layer(cfg, layer_index: int) -> bool:
    """transformers' rule: not in mlp_only_layers and on the decoder_sparse_step grid."""
    mlp_only = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer_index not in mlp_only and cfg.num_experts > 0 and (layer_index + 1) % step == 0


def _build(cfg, ctx: BuildContext, shape: MoEShape, *, qkv_bias: bool, qk_norm: str | None,
           sparse_rule=is_sparse_layer) -> CausalLM:
    routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="softmax",
                            renormalize=bool(getattr(cfg, "norm_topk_prob", False)))

    def make_layer(i: int) -> DecoderLayer:
        if sparse_rule(cfg, i):
            mlp = SparseMoE(shape, routing, ctx.executor, ctx.kernels, dtype=ctx.dtype, device=ctx.device,
                            quant=ctx.quant)
        else:
            mlp = ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size)
        attention = gqa_attention(cfg, i, ctx, qkv_bias=qkv_bias, qk_norm=qk_norm)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, ctx)

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)


def build_qwen2_moe(cfg, ctx: BuildContext) -> CausalLM:
    shape = MoEShape(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                     shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
                     shared_name="shared_expert")
    return _build(cfg, ctx, shape, qkv_bias=bool(getattr(cfg, "qkv_bias", True)), qk_norm=None)


def build_qwen3_moe(cfg, ctx: BuildContext) -> CausalLM:
    shape = MoEShape(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size)
    return _build(cfg, ctx, shape, qkv_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm="per_head")


def build_olmoe(cfg, ctx: BuildContext) -> CausalLM:
    shape = MoEShape(cfg.hidden_size, cfg.num_experts, cfg.intermediate_size)
    return _build(cfg, ctx, shape, qkv_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm="full",
                  sparse_rule=lambda c, i: True)
