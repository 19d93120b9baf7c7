"""GLM-4.5 / 4.6: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...</tool_call>`, one block per
call, after optional content (vLLM's `glm45` parser reads the same).

Values are text, not JSON: a parameter the tool's schema types as a string keeps its text exactly; any other
value is read as JSON, else as a Python literal (`True`, `'a'`), else kept as its stripped text, as vLLM does.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, replace
from typing import Any

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, expect_literal, find_marker, openai_call_id
from moe_runtime.server.tool_calls.tagged_arguments import ParameterTypes, as_json, continues_with, scan_pairs, tag_body

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
KEY_OPEN = "<arg_key>"
KEY_CLOSE = "</arg_key>"
VALUE_OPEN = "<arg_value>"
VALUE_CLOSE = "</arg_value>"
NAME_ENDS = ("\n", KEY_OPEN, CLOSE)


def glm_value(raw: str, json_type: str | None) -> Any:
    """The argument value GLM wrote as `raw`, typed as vLLM's glm45 parser types it (a value without a JSON form,
    such as NaN or a Python set, stays text)."""
    if json_type == "string":
        return raw
    text = raw.strip()
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return value if as_json(value) is not None else text
    return text


def read_key_value(text: str, k: int) -> tuple[str, str, int] | None:
    """`KEY</arg_key> <arg_value>VALUE</arg_value>` from `k` (after `<arg_key>`): key, raw value, end; None while
    incomplete."""
    key = tag_body(text, k, KEY_CLOSE)
    value_at = None if key is None else expect_literal(text, skip_whitespace(text, key[1]), VALUE_OPEN)
    value = None if value_at is None else tag_body(text, value_at, VALUE_CLOSE)
    return None if value is None else (key[0].strip(), value[0], value[1])


@dataclass(frozen=True)
class Glm45Parser:
    name: str = "glm45"
    parameter_types: ParameterTypes = ParameterTypes()

    def for_tools(self, tools: list[dict]) -> "Glm45Parser":
        """This parser typing values by the request's tool schemas."""
        return replace(self, parameter_types=ParameterTypes.of_tools(tools))

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (OPEN,), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        if not text.startswith(OPEN, i):
            return PENDING_CALL if continues_with(text, i, (OPEN,)) and not final else None
        body = i + len(OPEN)
        ends = [(found, end) for end in NAME_ENDS if (found := text.find(end, body)) >= 0]
        if not ends:
            return PENDING_CALL
        name_end, terminator = min(ends)
        name = text[body:name_end].strip()
        if not name or "<" in name:
            raise NotJson("a GLM tool call without a function name")
        return self._arguments(text, name, name_end + (1 if terminator == "\n" else 0))

    def _arguments(self, text: str, name: str, k: int) -> CallScan:
        """The key/value pairs from `k` on, up to `</tool_call>`."""
        return scan_pairs(text, name, k, CLOSE, KEY_OPEN, read_key_value,
                          lambda raw, key: glm_value(raw, self.parameter_types.type_of(name, key)))

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()
