"""Mixtral: GQA attention, softmax top-k (always renormalized) over w1/w3/w2 experts."""
from __future__ import annotations

from moe_runtime.kernels import RoutingConfig
from moe_runtime.moe.expert_weights import MIXTRAL_NAMING
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.models.common import gqa_attention
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack


def build_mixtral(cfg, ctx: BuildContext) -> CausalLM:
    routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=True)
    shape = MoEShape(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size)

    def make_layer(i: int) -> DecoderLayer:
        return DecoderLayer(
            gqa_attention(cfg, i, ctx),
            SparseMoE(shape, routing, ctx.executor, ctx.kernels, MIXTRAL_NAMING, ctx.dtype, ctx.device,
                      quant=ctx.quant),
            cfg.hidden_size, cfg.rms_norm_eps, ctx, mlp_name="block_sparse_moe",
        )

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)
