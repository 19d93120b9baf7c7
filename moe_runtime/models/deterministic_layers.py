"""`--deterministic` on a built model: every layer's mixer must have a fixed-order (batch-invariant) path.

The options the mode refuses before anything loads are config/deterministic.py's; this check needs the model's
layers, so it runs once the model is built (engine/model_setup.py).
"""
from __future__ import annotations

from torch import nn

from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.layers.attention import Attention
from moe_runtime.layers.mla import MultiHeadLatentAttention

# The attention layers with a fixed-order path, by exact type (a subclass runs kernels of its own): standard
# multi-head / grouped-query attention, and DeepSeek-V2/V3 / Kimi K2 multi-head latent attention (absorbed).
FIXED_ORDER_ATTENTION = (Attention, MultiHeadLatentAttention)


def check_deterministic_model(model: nn.Module, architecture: str) -> None:
    """Refuse a model with a layer whose mixer is not one of FIXED_ORDER_ATTENTION: those run their own kernels,
    not the fixed-order ones. Refused by name so far: DeepSeek Sparse Attention's MLA (DeepSeek-V3.2, GLM-5:
    SparseLatentAttention, whose indexer picks each row's keys), DeepSeek-V4's compressed attention
    (CompressedAttention) and linear attention (Qwen3-Next's GatedDeltaNet, and its GatedAttention)."""
    layers = model.model.owned_layers()
    mixers = {type(getattr(layer, "self_attn", layer)).__name__ for layer in layers
              if type(getattr(layer, "self_attn", None)) not in FIXED_ORDER_ATTENTION}
    if mixers:
        raise EngineConfigError(f"--deterministic with {architecture}: its {', '.join(sorted(mixers))} layers have "
                                "no batch-invariant kernels yet (standard multi-head / grouped-query attention "
                                "models only: Llama, Qwen2/3 (MoE), Mixtral, OLMoE, GLM-4 MoE, MiniMax-M2, "
                                "gpt-oss, Llama 4; and multi-head latent attention: DeepSeek-V2/V3, Kimi K2)")
