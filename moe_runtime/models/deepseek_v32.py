"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA, router and
MoE, with DeepSeek Sparse Attention: each layer's lightning indexer picks the `index_topk` tokens every query
attends to (moe_runtime/layers/sparse_mla.py).

GLM-5 differs in its MLA shapes (v_head_dim apart from qk_nope_head_dim, read from the config), rotates its
indexer's channels in interleaved pairs (DeepSeek-V3.2 in halves), and runs an indexer only on its "full" layers
(`indexer_types`): a "shared" layer attends to the tokens the last full layer below it chose.
"""
from __future__ import annotations

import torch

from moe_runtime.errors import InvalidRequestError
from moe_runtime.layers.attention_backend import attention_kernels_for
from moe_runtime.layers.lightning_indexer import IndexerShape, LightningIndexer
from moe_runtime.layers.sparse_mla import SparseLatentAttention
from moe_runtime.models.common import rotary_for
from moe_runtime.models.decoder import BuildContext, CausalLM
from moe_runtime.models.deepseek import build_mla_model, deepseek_v3_routing, mla_arguments

SHARED_INDEXER = "shared"   # GLM-5's indexer_types entry of a layer reusing the previous full layer's tokens


def selecting_layers(hf_config) -> list[int]:
    """[num_hidden_layers]: the layer whose indexer chooses each layer's tokens (itself, or for a shared layer
    the last full layer below it)."""
    kinds = getattr(hf_config, "indexer_types", None) or ["full"] * hf_config.num_hidden_layers
    chooser, choosers = None, []
    for layer, kind in enumerate(kinds):
        if kind != SHARED_INDEXER:
            chooser = layer
        elif chooser is None:
            raise InvalidRequestError(f"config.json indexer_types: layer {layer} is {SHARED_INDEXER!r} but no "
                                      "layer below it runs an indexer whose tokens it could reuse")
        choosers.append(chooser)
    return choosers


def indexer_layers(hf_config) -> tuple[int, ...]:
    """The layers that run an indexer (and keep index keys in their cache)."""
    return tuple(layer for layer, chooser in enumerate(selecting_layers(hf_config)) if chooser == layer)


def _build(cfg, ctx: BuildContext, *, interleaved_indexer_rope: bool) -> CausalLM:
    choosers = selecting_layers(cfg)
    stage = ctx.parallel.stage_layers
    if stage is not None and choosers[stage[0]] < stage[0]:
        raise InvalidRequestError(
            f"pp={ctx.parallel.pp_size}: pipeline stage layers {stage[0]}..{stage[1] - 1} start with a shared "
            f"indexer layer that reuses layer {choosers[stage[0]]}'s tokens, which another stage chooses; "
            "choose pp_layers so that every stage starts at a layer with an indexer of its own")
    def make_attention(i: int) -> SparseLatentAttention:
        return sparse_attention(cfg, ctx, choosers[i], interleaved_indexer_rope, own=choosers[i] == i)

    return build_mla_model(cfg, ctx, deepseek_v3_routing(cfg), make_attention, correction_bias=True)


def sparse_attention(cfg, ctx: BuildContext, selecting_layer: int, interleaved_indexer_rope: bool,
                     own: bool) -> SparseLatentAttention:
    """MLA over the tokens layer `selecting_layer`'s indexer chooses; `own`: this layer runs that indexer (a
    target's full layer, or an MTP block, which always chooses for itself)."""
    indexer = None
    if own:
        kernels = attention_kernels_for(ctx.kernels, torch.device(ctx.device))
        indexer = LightningIndexer(IndexerShape.from_config(cfg),
                                   rotary_for(cfg, cfg.qk_rope_head_dim, ctx.device, interleaved_indexer_rope),
                                   ctx.dtype, ctx.device, ctx.linear_quant, scores=kernels.index_scores)
    return SparseLatentAttention(**mla_arguments(cfg, ctx, interleaved_rope=True), indexer=indexer,
                                 selecting_layer=selecting_layer)


def build_deepseek_v32(cfg, ctx: BuildContext) -> CausalLM:
    return _build(cfg, ctx, interleaved_indexer_rope=False)


def build_glm_moe_dsa(cfg, ctx: BuildContext) -> CausalLM:
    return _build(cfg, ctx, interleaved_indexer_rope=True)
