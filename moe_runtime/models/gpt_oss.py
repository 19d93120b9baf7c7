"""gpt-oss (`GptOssForCausalLM`): every layer GQA attention with q/k/v/o biases, a learned sink logit per query
head and YaRN rotary, sliding-window and full layers alternating as `config.layer_types` says; every layer sparse.

Attention, as transformers' GptOssAttention: the span comes from `layer_types` (`sliding_window_of`, the same
rule `attention_spans` gives the KV cache manager, so a sliding layer's cache sits in its own bounded group); the
sinks (`self_attn.sinks` [num_heads]) join every row's softmax denominator and are split with the heads under
attention TP (`Attention.load_weights` reads this rank's slice). Rotary is neox-style halves with YaRN's
frequencies and attention factor (`rope_inverse_frequencies`).

MoE, as GptOssMLP: the router (`mlp.router`, weight and bias) picks the top-k logits and softmaxes over those k,
which is softmax over all experts renormalised over the chosen k; the experts (`mlp.experts.gate_up_proj`
[E, H, 2I] with gate/up columns interleaved, `down_proj` [E, I, H], both with biases; or their MXFP4
`*_blocks` / `*_scales`) run the clamped SwiGLU. Under `--quantization mxfp4` only the routed experts stay packed,
as the published checkpoints keep everything else in bf16: attention takes `ctx.linear_quant`.
"""
from __future__ import annotations

from moe_runtime.kernels import RoutingConfig
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.layers.attention import Attention, AttentionShape
from moe_runtime.layers.attention_span import SLIDING, AttentionSpan
from moe_runtime.models.common import head_dim_of, rotary_for, sliding_window_of
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack
from moe_runtime.moe.expert_weights import GPT_OSS_NAMING
from moe_runtime.moe.layer import MoEShape, SparseMoE


def gpt_oss_routing(cfg) -> RoutingConfig:
    """Top-k of the router logits, softmax over those k (= softmax over all, renormalised over the k)."""
    return RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="softmax", renormalize=True)


def gpt_oss_moe_shape(cfg) -> MoEShape:
    """Routed experts only (no shared expert), biases on the router and on both expert projections."""
    activation = ExpertActivation.gpt_oss(alpha=getattr(cfg, "swiglu_alpha", 1.702), limit=cfg.swiglu_limit)
    return MoEShape(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, router_bias=True,
                    expert_bias=True, router_name="router", activation=activation)


def gpt_oss_attention(cfg, layer_index: int, ctx: BuildContext) -> Attention:
    """Layer `layer_index`'s attention: biases on all four projections (`attention_bias`), sinks, its span."""
    window = sliding_window_of(cfg, layer_index)
    bias = bool(getattr(cfg, "attention_bias", True))
    head_dim = head_dim_of(cfg)
    shape = AttentionShape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        qkv_bias=bias,
        o_bias=bias,
        norm_eps=cfg.rms_norm_eps,
        span=AttentionSpan(SLIDING, window) if window else AttentionSpan(),
        sinks=True,
    )
    p = ctx.parallel
    return Attention(shape, rotary_for(cfg, head_dim, ctx.device), ctx.kernels, ctx.dtype, ctx.device,
                     p.attn_tp_size, p.attn_tp_rank, p.attn_tp_group, quant=ctx.linear_quant)


def build_gpt_oss(cfg, ctx: BuildContext) -> CausalLM:
    routing, shape = gpt_oss_routing(cfg), gpt_oss_moe_shape(cfg)

    def make_layer(i: int) -> DecoderLayer:
        moe = SparseMoE(shape, routing, ctx.executor, ctx.kernels, GPT_OSS_NAMING, ctx.dtype, ctx.device,
                        quant=ctx.quant)
        return DecoderLayer(gpt_oss_attention(cfg, i, ctx), moe, cfg.hidden_size, cfg.rms_norm_eps, ctx)

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)
