"""Each layer's attention span as the checkpoint's config declares it, for the whole model (every pipeline
stage asks the same, so their block managers keep the same KV cache groups)."""
from __future__ import annotations

from moe_runtime.layers.attention_span import SLIDING, AttentionSpan
from moe_runtime.models.common import sliding_window_of


def attention_spans(hf_config) -> list[AttentionSpan]:
    """[num_hidden_layers]: a sliding window where the config gives the layer one, else full attention."""
    spans = []
    for layer in range(hf_config.num_hidden_layers):
        window = sliding_window_of(hf_config, layer)
        spans.append(AttentionSpan(SLIDING, window) if window else AttentionSpan())
    return spans
