"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): GQA attention with partial rotary, optional per-head q/k norm and
q/k/v bias; DeepSeek-V3's router (sigmoid, correction bias for the choice, groups by their top-2 sum,
renormalised and scaled); shared experts; the first `first_k_dense_replace` layers dense.

The multi-token-prediction layer that follows the last decoder layer in published checkpoints
(`num_nextn_predict_layers`) is DeepSeek-V3's module around one more of these layers (`glm4_moe_layer_parts`):
the target's load skips its tensors (`SkippedTensors.for_config`) and the MTP drafter reads them
(moe_runtime/speculative/mtp_loading.py).
"""
from __future__ import annotations

from moe_runtime.layers.partial_rotary import partial_rotary_dim
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.models.common import gqa_attention, head_dim_of
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack
from moe_runtime.models.deepseek import LayerParts, deepseek_v3_routing


def glm4_moe_layer_parts(cfg, ctx: BuildContext, index: int) -> LayerParts:
    """Layer `index`'s attention and MLP (also the multi-token-prediction layer's block, past the last)."""
    routing = deepseek_v3_routing(cfg)   # transformers' Glm4MoeTopkRouter is DeepSeek-V3's, line for line
    moe_shape = MoEShape(
        cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size,
        shared_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
        shared_name="shared_experts", correction_bias=True,
    )
    rotary_dim = partial_rotary_dim(cfg, head_dim_of(cfg))
    qk_norm = "per_head" if getattr(cfg, "use_qk_norm", False) else None
    qkv_bias = bool(getattr(cfg, "attention_bias", False))   # o_proj has none
    if index >= (cfg.first_k_dense_replace or 0):
        mlp = SparseMoE(moe_shape, routing, ctx.executor, ctx.kernels, dtype=ctx.dtype, device=ctx.device,
                        quant=ctx.quant)
    else:
        mlp = ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size)
    return LayerParts(gqa_attention(cfg, index, ctx, qkv_bias=qkv_bias, qk_norm=qk_norm, rotary_dim=rotary_dim), mlp)


def build_glm4_moe(cfg, ctx: BuildContext) -> CausalLM:
    def make_layer(i: int) -> DecoderLayer:
        parts = glm4_moe_layer_parts(cfg, ctx, i)
        return DecoderLayer(parts.attention, parts.mlp, cfg.hidden_size, cfg.rms_norm_eps, ctx)

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)
