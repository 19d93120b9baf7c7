"""Which layers of a checkpoint attend sparsely through a lightning indexer (DeepSeek-V3.2, GLM-5): what the
KV cache layout asks before the model is built (moe_runtime/engine/kv_groups.py)."""
from __future__ import annotations

INDEXED_ATTENTION = "indexed_attention"   # transformers' layer_types entry of a DeepSeek Sparse Attention layer


def sparse_attention_layers(hf_config) -> tuple[int, ...]:
    """The model's layers whose queries attend to an indexer's top-k tokens (none without layer_types)."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(layer_types) if kind == INDEXED_ATTENTION)
