"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11) or
`[TOOL_CALLS]f[ARGS]{...}` once per call (v11 and later).

`[TOOL_CALLS]` is a special token, which the engine's decoding (skip_special_tokens) drops from the
text; an answer that opens with a JSON array of objects is therefore read as the calls too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace, value_end
from moe_runtime.server.tool_calls.object_calls import call_in_array
from moe_runtime.server.tool_calls.parser import (PENDING_CALL, CallScan, SectionStart, alphanumeric_call_id, arguments_start,
                                                 find_marker)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARRAY_OF_OBJECTS = re.compile(r"\[\s*\{")
OPEN_ARRAY = re.compile(r"\[\s*")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class MistralParser:
    name: str = "mistral"

    def find_start(self, text: str, final: bool) -> SectionStart:
        found = find_marker(text, (MARKER,), final)
        if found.index is not None:
            return found
        body = text.lstrip()
        lead = len(text) - len(body)
        if ARRAY_OF_OBJECTS.match(body):
            return SectionStart(lead)
        if body and not final and OPEN_ARRAY.fullmatch(body):
            return SectionStart(None, max(found.held, len(body)))
        return found

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        if text.startswith(MARKER, i):
            i = skip_whitespace(text, i + len(MARKER))
        elif i < len(text) and MARKER.startswith(text[i:]) and not final:
            return PENDING_CALL
        if i >= len(text):
            return None if final else PENDING_CALL
        if text[i] in "[,]":
            return call_in_array(text, i, final)
        return self._name_then_args(text, i)

    @staticmethod
    def _name_then_args(text: str, i: int) -> CallScan:
        separator = text.find(ARGS, i)
        if separator < 0:
            tail = next((k for k in range(len(ARGS) - 1, 0, -1) if text.endswith(ARGS[:k])), 0)   # "[AR..."
            if FUNCTION_NAME.fullmatch(text, i, len(text) - tail) is None:
                raise NotJson("a function name may hold letters, digits and _ . : - only")
            return PENDING_CALL
        name = text[i:separator].strip()
        if not name or FUNCTION_NAME.fullmatch(name) is None:
            raise NotJson("a tool call without a valid function name")
        start = arguments_start(text, separator + len(ARGS))
        if start is None:
            return PENDING_CALL
        end = value_end(text, start)
        return CallScan(name, text[start:end if end is not None else len(text)], end)

    def new_call_id(self, name: str, index: int) -> str:
        return alphanumeric_call_id()
