"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): GQA attention with partial rotary (`rotary_dim` of `head_dim`) and a q/k
RMSNorm over the whole projection (all heads at once, not per head); every layer sparse, experts named
w1/w3/w2 under `block_sparse_moe` (Mixtral's layout, as the published checkpoints and transformers' saved
ones have it).

Routing, as transformers' MiniMaxM2TopKRouter: sigmoid of the fp32 logits, the correction bias added for
the choice only, plain top-k (no groups), the chosen sigmoids renormalised to sum 1, no scaling. The
correction bias lives on the block (`block_sparse_moe.e_score_correction_bias`), not on the gate as in
DeepSeek-V3, so the router here reads it from there.

Under attention tensor parallelism the q/k norm's mean of squares spans every head: each rank's partial
sum is all-reduced (`TensorParallelRMSNorm`), which needs at least one KV head per rank (refused by name
otherwise).
"""
from __future__ import annotations

from moe_runtime.kernels import RoutingConfig
from moe_runtime.layers.partial_rotary import partial_rotary_dim
from moe_runtime.moe.expert_weights import MIXTRAL_NAMING
from moe_runtime.moe.layer import MoEShape, SparseMoE
from moe_runtime.moe.router import Router
from moe_runtime.models.common import gqa_attention, head_dim_of
from moe_runtime.models.decoder import BuildContext, CausalLM, DecoderLayer, build_stack
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked

GATE = "gate."


class BlockBiasRouter(Router):
    """The router whose correction bias is a tensor of the enclosing block (`<block>.e_score_correction_bias`)."""

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        copy_checked(self.weight, reader.read(f"{prefix}weight"), f"{prefix}weight", reader.directory)
        if not prefix.endswith(GATE):
            raise ValueError(f"the MiniMax-M2 router is loaded as '<block>.gate.', got {prefix!r}")
        name = f"{prefix[:-len(GATE)]}e_score_correction_bias"
        copy_checked(self.e_score_correction_bias, reader.read(name), name, reader.directory)
        return {"weight", "e_score_correction_bias"}


def minimax_m2_routing(cfg) -> RoutingConfig:
    return RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="sigmoid", renormalize=True)


def build_minimax_m2(cfg, ctx: BuildContext) -> CausalLM:
    routing = minimax_m2_routing(cfg)
    shape = MoEShape(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, correction_bias=True)
    rotary_dim = partial_rotary_dim(cfg, head_dim_of(cfg))

    def make_layer(i: int) -> DecoderLayer:
        moe = SparseMoE(shape, routing, ctx.executor, ctx.kernels, MIXTRAL_NAMING, ctx.dtype, ctx.device,
                        quant=ctx.quant)
        moe.gate = BlockBiasRouter(cfg.hidden_size, cfg.num_local_experts, True, ctx.dtype, ctx.device)
        attention = gqa_attention(cfg, i, ctx, qk_norm="full", rotary_dim=rotary_dim)
        return DecoderLayer(attention, moe, cfg.hidden_size, cfg.rms_norm_eps, ctx, mlp_name="block_sparse_moe")

    return CausalLM(cfg, build_stack(cfg, ctx, make_layer), cfg.tie_word_embeddings, ctx)
