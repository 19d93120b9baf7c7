"""Dense Llama / Qwen2 / Mistral: GQA attention and a SiLU MLP run as a single expert."""
from __future__ import annotations

from moe_runtime.models.common import gqa_attention
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack


def build_dense(cfg, ctx: BuildContext, *, qkv_bias: bool, o_bias: bool = False) -> CausalLM:
    def make_layer(i: int) -> DecoderLayer:
        return DecoderLayer(
            gqa_attention(cfg, i, ctx, qkv_bias=qkv_bias, o_bias=o_bias),
            ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size),
            cfg.hidden_size, cfg.rms_norm_eps, ctx,
        )

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)


def build_llama(cfg, ctx: BuildContext) -> CausalLM:
    bias = bool(getattr(cfg, "attention_bias", False))
    return build_dense(cfg, ctx, qkv_bias=bias, o_bias=bias)


def build_qwen2(cfg, ctx: BuildContext) -> CausalLM:
    return build_dense(cfg, ctx, qkv_bias=True)


def build_mistral(cfg, ctx: BuildContext) -> CausalLM:
    return build_dense(cfg, ctx, qkv_bias=False)
