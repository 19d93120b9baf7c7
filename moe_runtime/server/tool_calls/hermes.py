"""Qwen / Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call,
after optional content (Qwen2.5, Qwen3, Hermes 2/3, and the demo model's chat template)."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.server.tool_calls.json_scan import skip_whitespace
from moe_runtime.server.tool_calls.object_calls import call_in_object
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, find_marker, openai_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class HermesParser:
    name: str = "hermes"

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (OPEN,), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        if not text.startswith(OPEN, i):
            could_open = OPEN.startswith(text[i:])
            return PENDING_CALL if could_open and not final else None
        j = skip_whitespace(text, i + len(OPEN))
        if j >= len(text):
            return PENDING_CALL
        call = call_in_object(text, j)
        if call.end is None:
            return call
        return CallScan(call.name, call.arguments, self._after_close(text, call.end, final))

    @staticmethod
    def _after_close(text: str, pos: int, final: bool) -> int | None:
        """After the object: `</tool_call>` ends the call; a missing one is forgiven at the end of the text or
        when the next `<tool_call>` follows at once."""
        i = skip_whitespace(text, pos)
        if text.startswith(CLOSE, i):
            return i + len(CLOSE)
        if text.startswith(OPEN, i) or (final and i >= len(text)):
            return i
        rest = text[i:]
        if not final and (CLOSE.startswith(rest) or OPEN.startswith(rest)):
            return None
        return i   # something else follows: the call is complete, the section ends here

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()
