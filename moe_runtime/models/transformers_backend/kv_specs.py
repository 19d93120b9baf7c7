"""Each layer's KV cache spec from the HF config: heads, key/value dims and span.

The config's reading is where the shapes start; probe.py replaces them by what the modules compute (a config
field this reading does not know), and the attention function checks each layer's first real call against the
result. The span is attention_spans.layer_span's, the one the engine's KV cache groups are planned from.
"""
from __future__ import annotations

from moe_runtime.layers.kv_cache import KVCacheSpec
from moe_runtime.models.attention_spans import layer_span
from moe_runtime.models.common import head_dim_of
from moe_runtime.models.transformers_backend.step_context import LayerAttention


def layer_attention(cfg, layer: int) -> LayerAttention:
    """Multi-head latent attention (DeepSeek's q/kv LoRA) runs in transformers with its keys and values expanded
    per head: every head keeps qk_nope + qk_rope key channels and v_head_dim value channels. Any other attention
    keeps num_key_value_heads heads of head_dim."""
    span = layer_span(cfg, layer)
    try:
        if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_nope_head_dim", None) is not None:
            return LayerAttention(span, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                                  cfg.v_head_dim)
        head_dim = head_dim_of(cfg)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    except Exception as exc:   # noqa: BLE001 - a config that keeps these per layer (Gemma 4): the probe reads them
        return LayerAttention(span, 0, 0, 0, config_error=f"{type(exc).__name__}: {exc}")
    return LayerAttention(span, kv_heads, head_dim, head_dim)


def kv_cache_spec(layer: LayerAttention) -> KVCacheSpec:
    return KVCacheSpec(layer.num_kv_heads, layer.key_dim, layer.value_dim, 0, layer.num_kv_heads, layer.span)
