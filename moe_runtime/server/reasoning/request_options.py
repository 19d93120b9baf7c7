"""A request's wish to think, as the chat templates that read one take it (`thinking_variables`).

Each API says it its own way: Chat Completions' `reasoning_effort` (and vLLM's `chat_template_kwargs`), the
Responses API's `reasoning.effort`, the Messages API's `thinking.type`. The families read it under different
names: Qwen3, Qwen3.5 and GLM-4.5+ templates `enable_thinking`, DeepSeek-V3.1+ `thinking`, gpt-oss (harmony)
and some templates `reasoning_effort`. Every name is set; the template sees only those it reads
(`request_conversion.template_variables`), and the request's own `chat_template_kwargs` win.
"""
from __future__ import annotations

NO_REASONING_EFFORTS = frozenset({"none"})   # OpenAI's effort that turns reasoning off


def thinking_variables(enabled: bool | None, effort: str | None = None) -> dict:
    """Template variables for thinking on (True), off (False) or as the model likes (None), and an effort."""
    if effort is not None and effort in NO_REASONING_EFFORTS:
        enabled, effort = False, None
    variables: dict = {}
    if enabled is not None:
        variables["enable_thinking"] = variables["thinking"] = enabled
    if effort is not None:
        variables["reasoning_effort"] = effort
    return variables
