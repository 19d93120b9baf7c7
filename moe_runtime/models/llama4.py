"""Llama 4 text (`Llama4ForCausalLM`, transformers' Llama4TextConfig), assembled from the shared pieces.

Attention: GQA on every layer. `no_rope_layers[i]` is 1 where layer i uses rotary (transformers' `use_rope`);
those layers attend within chunks of `attention_chunk_size` (`layer_types` "chunked_attention", so their KV
cache group keeps only the current chunk's blocks) and take a weightless per-head RMS norm of q and k after
the rotary (`use_qk_norm`). The other layers (NoPE) see the whole context without any position embedding and,
with `attn_temperature_tuning`, scale their queries by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.
The rotary rotates adjacent channel pairs (Llama 4's complex form): `RotaryEmbedding(interleaved=True)`, whose
output keeps every q.k product and every per-head norm (it only reorders channels, the same for q and k).

MLP: layer i is MoE when i is in `moe_layers` (from `interleave_moe_layer_step`), else a dense MLP of
`intermediate_size_mlp`, both under `feed_forward`. The router is bias-free; each token goes to its top-1
expert with score sigmoid(logit), and the score scales the expert's INPUT (transformers' Llama4TextMoe:
expert(x * s), not expert(x) * s; the two differ because SiLU is not linear). `Llama4MoE` therefore scales
x by the score and hands the executor weight 1. A shared expert (`shared_expert`, `intermediate_size`) is
added. Experts are stored as input-major stacks (`LLAMA4_NAMING`).
"""
from __future__ import annotations

import torch

from moe_runtime.kernels import RoutingConfig, TopK
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.query_temperature import QueryTemperature
from moe_runtime.models.attention_spans import layer_span
from moe_runtime.models.common import head_dim_of, rotary_for
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack
from moe_runtime.moe.expert_weights import LLAMA4_NAMING
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.moe.stages import Staged


class Llama4MoE(SparseMoE):
    """Top-1 sigmoid routing that scales each token's input to its expert by the score (see the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        scaled, topk = self._scaled_input(x)
        return self._add_shared(x, self._executor.run(self.moe_layer, scaled, topk))

    def stages(self, x: torch.Tensor) -> Staged[torch.Tensor]:  # [T, H] -> [T, H]
        scaled, topk = self._scaled_input(x)
        out = yield from self._executor.stages(self.moe_layer, scaled, topk)
        return self._add_shared(x, out)

    def _scaled_input(self, x: torch.Tensor) -> tuple[torch.Tensor, TopK]:  # [T, H] -> [T, H], top-1 [T, 1]
        """x times its expert's score, and the choice with weight 1 (the executor then adds the output as is)."""
        topk = self._route(x)
        scaled = x * topk.weights.to(x.dtype)                # [T, H] * [T, 1]
        return scaled, TopK(weights=torch.ones_like(topk.weights), ids=topk.ids)


def llama4_routing(cfg) -> RoutingConfig:
    """sigmoid of the chosen logit, not renormalized (sigmoid is monotonic: the top logit is the top score)."""
    if cfg.num_experts_per_tok != 1:
        raise UnsupportedArchitectureError(
            f"Llama 4 with num_experts_per_tok={cfg.num_experts_per_tok}: transformers scales every chosen expert's "
            f"input by its own score, which the runtime implements for top-1 only (the published models)")
    return RoutingConfig(top_k=1, scoring="sigmoid")


def uses_rope(cfg, layer: int) -> bool:
    """transformers' `use_rope = no_rope_layers[layer]`: 1 rotates, 0 is a NoPE layer."""
    return bool(cfg.no_rope_layers[layer])


def llama4_attention(cfg, layer: int, ctx: BuildContext) -> Attention:
    rope = uses_rope(cfg, layer)
    temperature = None
    if cfg.attn_temperature_tuning and not rope:
        temperature = QueryTemperature(attn_scale=cfg.attn_scale, floor_scale=cfg.floor_scale)
    bias = bool(cfg.attention_bias)
    shape = AttentionShape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="l2" if cfg.use_qk_norm and rope else None,
        norm_eps=cfg.rms_norm_eps,
        span=layer_span(cfg, layer),
        query_temperature=temperature,
    )
    rotary = rotary_for(cfg, shape.head_dim, ctx.device, interleaved=True) if rope else None
    p = ctx.parallel
    return Attention(shape, rotary, ctx.kernels, ctx.dtype, ctx.device, p.attn_tp_size, p.attn_tp_rank,
                     p.attn_tp_group, quant=ctx.linear_quant)


def build_llama4(cfg, ctx: BuildContext) -> CausalLM:
    routing = llama4_routing(cfg)
    moe_shape = MoEShape(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size,
                         shared_intermediate_size=cfg.intermediate_size, shared_name="shared_expert",
                         router_name="router")
    moe_layers = set(cfg.moe_layers)

    def make_layer(i: int) -> DecoderLayer:
        if i in moe_layers:
            mlp = Llama4MoE(moe_shape, routing, ctx.executor, ctx.kernels, LLAMA4_NAMING, ctx.dtype, ctx.device,
                            quant=ctx.quant)
        else:
            mlp = ctx.dense_mlp(cfg.hidden_size, cfg.intermediate_size_mlp)
        return DecoderLayer(llama4_attention(cfg, i, ctx), mlp, cfg.hidden_size, cfg.rms_norm_eps, ctx,
                            mlp_name="feed_forward")

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)
