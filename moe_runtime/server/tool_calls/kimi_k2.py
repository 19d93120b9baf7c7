"""Kimi K2's tool-call tokens, after optional content (vLLM's `kimi_k2` parser reads the same):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>
    (more calls)<|tool_calls_section_end|>

Some checkpoints write the section's tokens in the singular (`<|tool_call_section_begin|>`); the `functions.`
prefix may be missing. The call id is the model's `functions.NAME:IDX`: Kimi's chat template writes a call's
id back verbatim, and the model expects that form when the conversation is replayed; calls the model wrote without
the prefix get it. Like DeepSeek's, the tokens must reach the text (decoded as text, not dropped as special).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace, value_end
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, arguments_start, find_marker
from moe_runtime.server.tool_calls.tagged_arguments import continues_with

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
FUNCTIONS = "functions."
CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s<]+):(?P<index>[0-9]+)")   # the name may hold . and :


def kimi_call_id(name: str, index: int | str) -> str:
    return f"{FUNCTIONS}{name}:{index}"


@dataclass(frozen=True)
class KimiK2Parser:
    name: str = "kimi_k2"

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (*SECTION_BEGINS, CALL_BEGIN), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        begin = next((marker for marker in SECTION_BEGINS if text.startswith(marker, i)), None)
        if begin is not None:
            i = skip_whitespace(text, i + len(begin))
        if not text.startswith(CALL_BEGIN, i):
            if not final and continues_with(text, i, (CALL_BEGIN, *SECTION_BEGINS, *SECTION_ENDS)):
                return PENDING_CALL
            return None   # the section's end, or text after the calls: not read
        id_start = i + len(CALL_BEGIN)
        separator = text.find(ARGUMENT_BEGIN, id_start)
        if separator < 0:
            written = text[id_start:]
            marker = written.find("<")
            if marker >= 0 and not ARGUMENT_BEGIN.startswith(written[marker:]):
                raise NotJson(f"expected {ARGUMENT_BEGIN!r} after the call id")
            return PENDING_CALL
        found = CALL_ID.fullmatch(text[id_start:separator].strip())
        if found is None:
            raise NotJson("a Kimi K2 call id is functions.NAME:INDEX")
        name, call_id = found["name"], kimi_call_id(found["name"], found["index"])
        start = arguments_start(text, separator + len(ARGUMENT_BEGIN))
        if start is None:
            return PENDING_CALL
        end = value_end(text, start)
        if end is None:
            return CallScan(name, text[start:], None, call_id)
        return CallScan(name, text[start:end], self._after_arguments(text, end, final), call_id)

    @staticmethod
    def _after_arguments(text: str, pos: int, final: bool) -> int | None:
        """The index after `<|tool_call_end|>`; a missing one is forgiven at the very end of the text, or where
        something else follows (which ends the section)."""
        i = skip_whitespace(text, pos)
        if text.startswith(CALL_END, i):
            return i + len(CALL_END)
        if i >= len(text) or CALL_END.startswith(text[i:]):
            return len(text) if final else None
        return i

    def new_call_id(self, name: str, index: int) -> str:
        return kimi_call_id(name, index)
