"""DeepSeek-V3's tool-call tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>  (more calls)  <｜tool▁calls▁end｜>

The tokens are added tokens that are not special, so they reach the text with the default decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace, value_end
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan, SectionStart, arguments_start, find_marker, openai_call_id

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEPARATOR = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "```"


@dataclass(frozen=True)
class DeepSeekV3Parser:
    name: str = "deepseek_v3"

    def find_start(self, text: str, final: bool) -> SectionStart:
        return find_marker(text, (CALLS_BEGIN, CALL_BEGIN), final)

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        i = skip_whitespace(text, pos)
        if text.startswith(CALLS_BEGIN, i):
            i = skip_whitespace(text, i + len(CALLS_BEGIN))
        if not text.startswith(CALL_BEGIN, i):
            rest = text[i:]
            could_begin = CALL_BEGIN.startswith(rest) or CALLS_BEGIN.startswith(rest)
            return PENDING_CALL if could_begin and not final else None
        separator = text.find(SEPARATOR, i + len(CALL_BEGIN))
        if separator < 0:
            return PENDING_CALL
        name_end = text.find("\n", separator + len(SEPARATOR))
        if name_end < 0:
            return PENDING_CALL
        name = text[separator + len(SEPARATOR):name_end].strip()
        if not name:
            raise NotJson("a tool call without a function name")
        fence = skip_whitespace(text, name_end)
        if not text.startswith(FENCE_OPEN, fence):
            if FENCE_OPEN.startswith(text[fence:]):
                return PENDING_CALL
            raise NotJson(f"expected {FENCE_OPEN!r} after the function name")
        start = arguments_start(text, fence + len(FENCE_OPEN))
        if start is None:
            return PENDING_CALL
        end = value_end(text, start)
        if end is None:
            return CallScan(name, text[start:], None)
        return CallScan(name, text[start:end], self._after_arguments(text, end, final))

    @staticmethod
    def _after_arguments(text: str, pos: int, final: bool) -> int | None:
        """The index after the closing fence and `<｜tool▁call▁end｜>`; what is missing at the very end of
        the text is forgiven."""
        i = pos
        for literal in (FENCE_CLOSE, CALL_END):
            i = skip_whitespace(text, i)
            if text.startswith(literal, i):
                i += len(literal)   # whitespace after the call is not its own: where it ends must not depend on
            elif i >= len(text) or literal.startswith(text[i:]):   # how much of the text has come
                return len(text) if final else None
            else:
                return i
        return i

    def new_call_id(self, name: str, index: int) -> str:
        return openai_call_id()
