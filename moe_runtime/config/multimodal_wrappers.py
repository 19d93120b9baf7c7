"""Multimodal releases served as their text model: the wrapper's config and tensor names, read as the text model's.

Qwen3.5-MoE, Llama 4 and Kimi K2.5 ship as `...ForConditionalGeneration`: the decoder's config under `text_config`,
its tensors under a prefix (`model.language_model.` / `language_model.model.`), beside a vision tower and projector.
Kimi K2.5's wrapper (`model_type: kimi_k25`) and text model (`kimi_k2`) are types only its remote code defines:
moe_runtime/config/model_config.py reads them as DeepSeek-V3's, without running that code.
`text_model_config` turns such a config into the text model's (architecture, dtype and quantization carried
over from the top level), which is all the rest of the runtime sees; `MultimodalWrapper.rename` gives the
loader the text model's tensor names, and the vision tensors are skipped unread (`vision_prefixes`). Images are
not served: the server says so at start-up and refuses image content naming it. Serving them is a later stage
of its own (SGLang and vLLM run the vision encoder before the decoder's prefill): the wrapper recorded on the
config (`wrapper_of`) is where it will look.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from moe_runtime.errors import UnsupportedArchitectureError

WRAPPER_ATTRIBUTE = "multimodal_wrapper"   # set on the text config: the wrapper it came from


@dataclass(frozen=True)
class MultimodalWrapper:
    name: str                                  # config.json's architecture
    text_architecture: str                     # the text model the runtime builds
    renames: tuple[tuple[str, str], ...]       # stored name prefix -> the text model's
    vision_prefixes: tuple[str, ...]           # tensors of the vision tower and projector (not loaded)

    def rename(self, stored: str) -> str:
        for prefix, replacement in self.renames:
            if stored.startswith(prefix):
                return replacement + stored[len(prefix):]
        return stored


WRAPPERS = {wrapper.name: wrapper for wrapper in (
    MultimodalWrapper("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                      (("model.language_model.", "model."),), ("model.visual.",)),
    MultimodalWrapper("Llama4ForConditionalGeneration", "Llama4ForCausalLM",
                      (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
                      ("vision_model.", "multi_modal_projector.")),
    MultimodalWrapper("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM",
                      (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
                      ("vision_tower.", "mm_projector.")),
)}


def text_model_config(hf_config):
    """The text model's config for a multimodal wrapper's (`hf_config` itself for any other)."""
    architectures = getattr(hf_config, "architectures", None) or []
    wrapper = WRAPPERS.get(architectures[0]) if architectures else None
    if wrapper is None:
        return hf_config
    text = getattr(hf_config, "text_config", None)
    if text is None or not getattr(text, "num_hidden_layers", None):
        raise UnsupportedArchitectureError(f"{wrapper.name}: config.json has no text_config with the decoder's "
                                           "fields (num_hidden_layers, ...), which is the model served")
    text = copy.deepcopy(text)
    text.architectures = [wrapper.text_architecture]
    for name in ("torch_dtype", "dtype", "quantization_config"):
        outer = getattr(hf_config, name, None)
        if outer is not None and getattr(text, name, None) is None:
            setattr(text, name, outer)
    setattr(text, WRAPPER_ATTRIBUTE, wrapper.name)
    return text


def wrapper_of(hf_config) -> MultimodalWrapper | None:
    """The wrapper a text config was read from (None: the checkpoint is a text model)."""
    return WRAPPERS.get(getattr(hf_config, WRAPPER_ATTRIBUTE, None))
