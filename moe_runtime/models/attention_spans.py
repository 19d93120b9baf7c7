"""Each layer's attention span as the checkpoint's config declares it, for the whole model (every pipeline
stage asks the same, so their block managers keep the same KV cache groups)."""
from __future__ import annotations

from moe_runtime.layers.attention_span import CHUNKED, SLIDING, AttentionSpan
from moe_runtime.models.common import sliding_window_of

CHUNKED_LAYER_TYPE = "chunked_attention"   # transformers' layer_types entry for chunked local attention (Llama 4)


def layer_span(hf_config, layer: int) -> AttentionSpan:
    """Chunks of `attention_chunk_size` where layer_types says "chunked_attention", a sliding window where the
    config gives the layer one, else full attention. The model builders declare the same span (one source)."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer] == CHUNKED_LAYER_TYPE:
        return AttentionSpan(CHUNKED, hf_config.attention_chunk_size)
    window = sliding_window_of(hf_config, layer)
    return AttentionSpan(SLIDING, window) if window else AttentionSpan()


def attention_spans(hf_config) -> list[AttentionSpan]:
    """[num_hidden_layers]: each layer's `layer_span`."""
    return [layer_span(hf_config, layer) for layer in range(hf_config.num_hidden_layers)]
