"""Each layer's KV cache spec from the HF config: heads, key/value dims and span.

The specs are needed before any forward (the engine sizes the cache from them), so they come from the config as
transformers' attention modules read it; the attention function checks each layer's first call against its
spec and refuses a disagreement by name (a config field this reading does not know). The span is
attention_spans.layer_span's, the one the engine's KV cache groups are planned from.
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
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_nope_head_dim", None) is not None:
        return LayerAttention(span, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                              cfg.v_head_dim)
    head_dim = head_dim_of(cfg)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return LayerAttention(span, kv_heads, head_dim, head_dim)


def kv_cache_spec(layer: LayerAttention) -> KVCacheSpec:
    return KVCacheSpec(layer.num_kv_heads, layer.key_dim, layer.value_dim, 0, layer.num_kv_heads, layer.span)
