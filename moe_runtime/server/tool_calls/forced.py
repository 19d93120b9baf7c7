"""Calls forced through structured output (`tool_choice` required or named): the whole answer is a JSON
array of `{"name": ..., "arguments": {...}}` objects, as the schema from `server.tool_calls.forced_schema`
makes it, so no model family's format is involved."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_runtime.server.tool_calls.object_calls import call_in_array
from moe_runtime.server.tool_calls.parser import CallScan, SectionStart, openai_call_id_for


@dataclass(frozen=True)
class ForcedCallsParser:
    call_ids: Callable[[str, int], str] = openai_call_id_for   # the family's ids, so replayed history fits its template
    name: str = "forced"

    def find_start(self, text: str, final: bool) -> SectionStart:
        return SectionStart(0)   # no content: the answer is the calls

    def scan_call(self, text: str, pos: int, final: bool) -> CallScan | None:
        return call_in_array(text, pos, final)

    def new_call_id(self, name: str, index: int) -> str:
        return self.call_ids(name, index)
