"""Which reasoning reading a served model gets: `--reasoning-parser NAME`, else none, except for gpt-oss.

Reasoning is off by default, as in vLLM and SGLang: the same model type may or may not think (Qwen3 with
`enable_thinking: false`, DeepSeek-V3 vs R1), and a split a model does not write would turn its answer's
text into reasoning. gpt-oss is the exception: it always answers in harmony channels, whose markers are
meaningless as content, so a `gpt_oss` model type (config.json's, `GptOssForCausalLM`) gets harmony,
prompts and answers (vLLM decides by the same model type); `--reasoning-parser gpt_oss` asks for it on a
checkpoint that declares another type.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from moe_runtime.server.reasoning.parser import ReasoningParser
from moe_runtime.server.reasoning.think_tags import AppendThinkParser, ThinkTagParser

HARMONY = "gpt_oss"
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
THINK_PARSERS = MappingProxyType({
    "deepseek_r1": ThinkTagParser("deepseek_r1", implicit_start=True),
    # DeepSeek-V3.1+ (V3.2, V4): its template opens <think> when `thinking` is on and closes it when off, so the
    # prompt's end decides (`prompt_state`); a prompt that says nothing has no reasoning
    "deepseek_v3": ThinkTagParser("deepseek_v3", implicit_start=False),
    # Kimi-K2-Thinking (and K2.5) write <think>...</think> themselves
    "kimi_k2": ThinkTagParser("kimi_k2", implicit_start=False),
    "minimax_m2": ThinkTagParser("minimax_m2", implicit_start=True),
    "qwen3": ThinkTagParser("qwen3", implicit_start=False),
    "glm45": ThinkTagParser("glm45", implicit_start=False),
    "minimax_m2_append_think": AppendThinkParser("minimax_m2_append_think"),
})


class ReasoningChoiceError(ValueError):
    """A `--reasoning-parser` that cannot read this model's answers."""


@dataclass(frozen=True)
class ReasoningChoice:
    parser: ReasoningParser | None = None   # a <think> family
    harmony: bool = False                   # harmony channels (gpt-oss): prompts and answers


def choose_reasoning(flag: str | None, model_type: str | None) -> ReasoningChoice:
    if model_type in HARMONY_MODEL_TYPES:
        if flag not in (None, HARMONY):
            raise ReasoningChoiceError(f"--reasoning-parser {flag}: this model ({model_type}) answers in harmony "
                                       f"channels; leave the flag out or give {HARMONY}")
        return ReasoningChoice(harmony=True)
    if flag == HARMONY:
        return ReasoningChoice(harmony=True)
    if flag is None:
        return ReasoningChoice()
    return ReasoningChoice(parser=THINK_PARSERS[flag])
