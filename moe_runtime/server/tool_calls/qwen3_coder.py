"""Qwen3-Coder and Qwen3.5: one `<tool_call>` block per call, after optional content (vLLM's `qwen3_coder` parser
reads the same):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A `<function=...>` without the `<tool_call>` around it is read too, as vLLM does. A value is the text between its
tags less one newline at each end; it ends at `</parameter>`, or (vLLM forgives the missing tag) where the next
`<parameter=` or the `</function>` begins. Values are typed by the tool's schema as vLLM types them
(`qwen3_coder_value`).
"""
from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, find_marker, openai_call_id
from moe_runtime.server.tool_calls.tagged_arguments import ParameterTypes, as_json, continues_with, scan_pairs, tag_body

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
TAG_END = ">"
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")   # prefixes
NUMBER_TYPES = ("num", "float")                                 # prefixes
BOOLEAN_TYPES = ("boolean", "bool", "binary")
STRUCTURED_TYPES = ("object", "array", "arr")
LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def python_literal(text: str) -> Any:
    """`text` as a Python literal with a JSON form, or the text itself."""
    try:
        value = ast.literal_eval(text)
    except LITERAL_ERRORS:
        return text
    return value if as_json(value) is not None else text


def qwen3_coder_value(raw: str, json_type: str | None) -> Any:
    """The value Qwen3-Coder wrote as `raw`, typed by its parameter's schema `type` as vLLM types it: `null` is
    null whatever the type; strings (and parameters without a known type) stay text; integers and numbers are
    parsed, booleans are `true` or false; objects and arrays are JSON, else a Python literal; what does not parse
    stays text."""
    if raw.lower() == "null":
        return None
    kind = (json_type or "string").strip().lower()
    if kind in STRING_TYPES:
        return raw
    if kind.startswith(INTEGER_TYPES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(NUMBER_TYPES):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(number):
            return raw
        return int(number) if number.is_integer() else number
    if kind in BOOLEAN_TYPES:
        return raw.lower() == "true"
    if kind in STRUCTURED_TYPES or kind.startswith(("dict", "list")):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            return python_literal(raw)
        return value if as_json(value) is not None else raw
    return python_literal(raw)


def read_parameter(text: str, k: int) -> tuple[str, str, int] | None:
    """`NAME>VALUE</parameter>` from `k` (after `<parameter=`): name, raw value, end; None while incomplete. A value
    without its closing tag ends where the next parameter or the function's end begins (not consumed)."""
    header = tag_body(text, k, TAG_END)
    if header is None:
        return None
    name, start = header[0].strip(), header[1]
    ends = [(found, found + (len(tag) if tag == PARAMETER_CLOSE else 0))
            for tag in (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE) if (found := text.find(tag, start)) >= 0]
    if not ends:
        return None
    stop, after = min(ends)
    value = text[start:stop]
    value = value[1:] if value.startswith("\n") else value
    value = value[:-1] if value.endswith("\n") else value
    return name, value, after


@dataclass(frozen=True)
class Qwen3CoderParser:
    name: str = "qwen3_coder"
    parameter_types: ParameterTypes = ParameterTypes()

    def for_tools(self, tools: list[dict]) -> "Qwen3CoderParser":
        """This parser typing values by the request's tool schemas."""
        return replace(self, parameter_types=ParameterTypes.of_tools(tools))

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (OPEN, FUNCTION_OPEN), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        wrapped = text.startswith(OPEN, i)
        if wrapped:
            i = skip_whitespace(text, i + len(OPEN))
        if not text.startswith(FUNCTION_OPEN, i):
            if not final and continues_with(text, i, (FUNCTION_OPEN,) if wrapped else (OPEN, FUNCTION_OPEN)):
                return PENDING_CALL
            if wrapped:
                raise NotJson(f"expected {FUNCTION_OPEN!r} inside {OPEN!r}")
            return None   # the calls are over; what follows is not read
        header = tag_body(text, i + len(FUNCTION_OPEN), TAG_END)
        if header is None:
            if "<" in text[i + len(FUNCTION_OPEN):]:
                raise NotJson("a Qwen3-Coder function name cannot hold '<'")
            return PENDING_CALL
        name = header[0].strip()
        if not name or "<" in name:
            raise NotJson("a Qwen3-Coder tool call without a function name")
        call = scan_pairs(text, name, header[1], FUNCTION_CLOSE, PARAMETER_OPEN, read_parameter,
                          lambda raw, key: qwen3_coder_value(raw, self.parameter_types.type_of(name, key)))
        if call.end is None:
            return call
        return CallScan(call.name, call.arguments, self._after_function(text, call.end, wrapped, final))

    @staticmethod
    def _after_function(text: str, pos: int, wrapped: bool, final: bool) -> int | None:
        """After `</function>`: `</tool_call>` ends a wrapped call; a missing one is forgiven at the end of the text
        or where something else follows (the next call, or text that ends the section)."""
        if not wrapped:
            return pos
        i = skip_whitespace(text, pos)
        if text.startswith(CLOSE, i):
            return i + len(CLOSE)
        if i >= len(text) or CLOSE.startswith(text[i:]):
            return len(text) if final else None
        return i

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()
