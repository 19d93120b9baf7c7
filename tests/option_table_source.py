"""The model traits of every architecture the runtime serves, from the tiny test configs (no weights), for the
options-by-family table of docs/design.md and its tests."""
from __future__ import annotations

from tiny_checkpoints import TINY_ARCHS, tiny_config, tiny_tokenizer

from moe_runtime.front.model_options import ModelTraits


def configs_of_every_architecture() -> dict[str, object]:
    """architecture -> a tiny transformers config naming it (as save_pretrained writes `architectures`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tokenizer = tiny_tokenizer()
    configs = {}
    for arch in TINY_ARCHS:
        config = tiny_config(arch, tokenizer)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        configs.setdefault(config.architectures[0], config)
    return configs


def model_traits_of_every_architecture() -> list[ModelTraits]:
    return [ModelTraits.of_config(config) for config in configs_of_every_architecture().values()]
