"""Which parser reads a model's tool calls: `--tool-call-parser NAME`, else the format its chat template
writes, else its model type (`config.json`).

Templates give themselves away by the markers they write (`<tool_call>`, DeepSeek's and Kimi's tool-call
tokens, `[TOOL_CALLS]`, Qwen3-Coder's `<parameter=`), which is more reliable than the model type: the demo
model is a DeepSeek-V3 whose template writes Hermes calls, Qwen3-Coder is a `qwen3_moe` like Qwen3 whose
template writes XML-tagged calls instead of Hermes' JSON, and Kimi K2 is a DeepSeek-V3 with its own tokens.
Model types map to a parser only where every checkpoint of the type writes that format (Qwen3.5's
`qwen3_5_moe`: Qwen3-Coder's format; Qwen3-Next's is left to its template). A template without tool support
gets the Hermes rendering from `server.tool_calls.fallback_rendering`, so Hermes reads its answers. A model none of this identifies
has no parser: `tool_choice` auto is then refused, required and named still work (structured output).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

from moe_runtime.server.tool_calls import deepseek_v3, glm45, hermes, kimi_k2, minimax_m2, mistral, qwen3_coder
from moe_runtime.server.tool_calls.deepseek_v3 import DeepSeekV3Parser
from moe_runtime.server.tool_calls.glm45 import Glm45Parser
from moe_runtime.server.tool_calls.hermes import HermesParser
from moe_runtime.server.tool_calls.kimi_k2 import KimiK2Parser
from moe_runtime.server.tool_calls.minimax_m2 import MiniMaxM2Parser
from moe_runtime.server.tool_calls.mistral import MistralParser
from moe_runtime.server.tool_calls.parser import ToolCallParser
from moe_runtime.server.tool_calls.qwen3_coder import Qwen3CoderParser

PARSERS = MappingProxyType({"hermes": HermesParser(), "deepseek_v3": DeepSeekV3Parser(), "mistral": MistralParser(),
                            "glm45": Glm45Parser(), "minimax_m2": MiniMaxM2Parser(), "kimi_k2": KimiK2Parser(),
                            "qwen3_coder": Qwen3CoderParser()})
# GLM-4.5's and Qwen3-Coder's templates write `<tool_call>` too: their `<arg_key>` and `<parameter=` are looked
# for before Hermes' marker (MiniMax-M2 writes `<parameter name=`, which is not Qwen3-Coder's); the tokens of
# MiniMax-M2 and Kimi K2 are their own, whatever else a template mentions
TEMPLATE_MARKERS = ((glm45.KEY_OPEN, "glm45"), (minimax_m2.SECTION_OPEN, "minimax_m2"),
                    (kimi_k2.SECTION_BEGINS[0], "kimi_k2"), (qwen3_coder.PARAMETER_OPEN, "qwen3_coder"),
                    (hermes.OPEN, "hermes"), (deepseek_v3.CALLS_BEGIN, "deepseek_v3"), (mistral.MARKER, "mistral"))
MODEL_TYPE_PARSERS = MappingProxyType({
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "qwen3_5_moe": "qwen3_coder",
    "deepseek_v3": "deepseek_v3", "kimi_k2": "kimi_k2",
    "mistral": "mistral", "mixtral": "mistral",
    "glm4_moe": "glm45", "minimax_m2": "minimax_m2",
})


def template_supports_tools(chat_template: object) -> bool:
    """Whether the template reads the `tools` variable (transformers passes `tools=` to every template)."""
    return isinstance(chat_template, str) and "tools" in chat_template


def choose_parser(flag: str | None, chat_template: object, model_type: str | None) -> ToolCallParser | None:
    if flag is not None:
        return PARSERS[flag]
    if isinstance(chat_template, str):
        for marker, name in TEMPLATE_MARKERS:
            if marker in chat_template:
                return PARSERS[name]
        if not template_supports_tools(chat_template):
            return PARSERS["hermes"]
    name = MODEL_TYPE_PARSERS.get(model_type or "")
    return PARSERS[name] if name is not None else None


def checkpoint_model_type(checkpoint: str | Path) -> str | None:
    """`model_type` from the checkpoint's config.json (None if it has none or cannot be read)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None
