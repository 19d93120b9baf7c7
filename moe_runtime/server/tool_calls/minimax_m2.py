"""MiniMax-M2: calls as `<invoke>` elements inside `<minimax:tool_call>...</minimax:tool_call>`, after optional content
(vLLM's `minimax_m2` parser reads the same):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

Each `<invoke>` is one call. Values are text, stripped of surrounding whitespace, then typed by the tool's
schema as vLLM types them: `null` is null whatever the type; integers, numbers, booleans, objects and arrays are
parsed (the text is kept where it does not parse); strings, and parameters without a known type, stay text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, find_marker, openai_call_id
from moe_runtime.server.tool_calls.tagged_arguments import ParameterTypes, as_json, continues_with, scan_pairs, tag_body

SECTION_OPEN = "<minimax:tool_call>"
SECTION_CLOSE = "</minimax:tool_call>"
INVOKE_OPEN = "<invoke name="
INVOKE_CLOSE = "</invoke>"
PARAMETER_OPEN = "<parameter name="
PARAMETER_CLOSE = "</parameter>"
TAG_END = ">"


def attribute_value(text: str) -> str:
    """`"name"`, `'name'` or `name` -> name."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def minimax_value(raw: str, json_type: str | None) -> Any:
    """The parameter value MiniMax-M2 wrote as `raw`, typed as vLLM's minimax_m2 parser types it."""
    text = raw.strip()
    kind = (json_type or "string").lower()
    if text.lower() == "null":
        return None
    if kind in ("string", "str", "text"):
        return text
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return text
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() else (number if as_json(number) is not None else text)
    if kind in ("boolean", "bool"):
        return text.lower() in ("true", "1")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):   # nesting deeper than Python recurses is no value either
        return text
    return value if as_json(value) is not None else text


def read_parameter(text: str, k: int) -> tuple[str, str, int] | None:
    """`"NAME">VALUE</parameter>` from `k` (after `<parameter name=`): name, raw value, end; None while incomplete."""
    header = tag_body(text, k, TAG_END)
    value = None if header is None else tag_body(text, header[1], PARAMETER_CLOSE)
    return None if value is None else (attribute_value(header[0]), value[0], value[1])


@dataclass(frozen=True)
class MiniMaxM2Parser:
    name: str = "minimax_m2"
    parameter_types: ParameterTypes = ParameterTypes()

    def for_tools(self, tools: list[dict]) -> "MiniMaxM2Parser":
        """This parser typing values by the request's tool schemas."""
        return replace(self, parameter_types=ParameterTypes.of_tools(tools))

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (SECTION_OPEN,), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i, opened = skip_whitespace(text, pos), False
        while text.startswith(SECTION_OPEN, i) or text.startswith(SECTION_CLOSE, i):   # between sections
            opened = text.startswith(SECTION_OPEN, i)
            i = skip_whitespace(text, i + len(SECTION_OPEN if opened else SECTION_CLOSE))
        if not text.startswith(INVOKE_OPEN, i):
            if not final and continues_with(text, i, (INVOKE_OPEN, SECTION_OPEN, SECTION_CLOSE)):
                return PENDING_CALL
            if opened:
                raise NotJson(f"expected {INVOKE_OPEN!r} inside {SECTION_OPEN!r}")
            return None   # the calls are over; what follows is not read
        header = tag_body(text, i + len(INVOKE_OPEN), TAG_END)
        if header is None:
            return PENDING_CALL
        name = attribute_value(header[0])
        if not name or "<" in name:
            raise NotJson("an <invoke> without a function name")
        return self._parameters(text, name, header[1])

    def _parameters(self, text: str, name: str, k: int) -> CallScan:
        """The parameters from `k` on, up to `</invoke>`."""
        return scan_pairs(text, name, k, INVOKE_CLOSE, PARAMETER_OPEN, read_parameter,
                          lambda raw, key: minimax_value(raw, self.parameter_types.type_of(name, key)))

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()
