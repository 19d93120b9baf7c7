"""What the XML-tagged tool-call formats share (GLM-4.5's `<arg_key>/<arg_value>`, MiniMax-M2's
`<parameter name=...>`): arguments written one tagged pair at a time, turned into the JSON object OpenAI
clients expect.

A value's JSON type depends on the tool's parameter schema (a string parameter keeps the text as written,
others are parsed), as vLLM's parsers convert them. Arguments stream one complete pair at a time: a value
cut mid-way cannot be typed yet (`12` may still become `123` or `12 apples`), and whatever is sent must stay
a prefix of the final JSON text. So the text known so far is `{` and the complete pairs, and `}` closes it
once the call is complete.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moe_runtime.server.tool_calls.json_scan import NotJson, skip_whitespace
from moe_runtime.server.tool_calls.parser import CallScan

PairReader = Callable[[str, int], "tuple[str, str, int] | None"]   # (text, after the pair's opening) -> key, raw, end
Typing = Callable[[str, str], Any]                                  # (raw value, key) -> the value

@dataclass(frozen=True)
class ParameterTypes:
    """(tool name, parameter name, its JSON schema `type`) for every typed parameter of a request's tools.

    A tuple, so that a parser holding it stays hashable and immutable like the parsers without it."""

    types: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def of_tools(cls, tools: list[dict]) -> "ParameterTypes":
        """From OpenAI tool definitions (`{"type": "function", "function": {"name", "parameters"}}`)."""
        found = []
        for tool in tools:
            function = tool.get("function") or {}
            properties = (function.get("parameters") or {}).get("properties") or {}
            found += [(function.get("name", ""), name, spec["type"]) for name, spec in properties.items()
                      if isinstance(spec, dict) and isinstance(spec.get("type"), str)]
        return cls(tuple(found))

    def type_of(self, tool: str, parameter: str) -> str | None:
        return next((kind for name, param, kind in self.types if (name, param) == (tool, parameter)), None)


def as_json(value: Any) -> str | None:
    """`value` as strict JSON text, or None when it has no JSON form (a set, NaN, nesting too deep to write, ...)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def arguments_so_far(pairs: list[tuple[str, Any]], complete: bool) -> str:
    """The arguments' JSON text from the complete pairs: "" before the first, `}` only once the call is complete."""
    if not pairs and not complete:
        return ""
    members = ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {as_json(value)}" for key, value in pairs)
    return "{" + members + ("}" if complete else "")


def tag_body(text: str, start: int, close: str) -> tuple[str, int] | None:
    """The text from `start` up to the tag `close` and the index after that tag, or None while `close` has not come."""
    end = text.find(close, start)
    if end < 0:
        return None
    return text[start:end], end + len(close)


def continues_with(text: str, pos: int, literals: tuple[str, ...]) -> bool:
    """Whether what follows `pos` (all of it) could still grow into one of `literals`."""
    rest = text[pos:]
    return any(literal.startswith(rest) for literal in literals)


def scan_pairs(text: str, name: str, k: int, close: str, pair_open: str, read_pair: PairReader,
               typed: Typing) -> CallScan:
    """The call `name` from `k` on: tagged pairs (each opening with `pair_open`, read by `read_pair`, None while
    incomplete) until `close`. Raises `NotJson` where something else stands between them."""
    pairs: list[tuple[str, Any]] = []
    while True:
        k = skip_whitespace(text, k)
        if text.startswith(close, k):
            return CallScan(name, arguments_so_far(pairs, complete=True), k + len(close))
        if not text.startswith(pair_open, k):
            if continues_with(text, k, (close, pair_open)):
                return CallScan(name, arguments_so_far(pairs, complete=False), None)
            raise NotJson(f"expected {pair_open!r} or {close!r} in the call of {name!r}")
        pair = read_pair(text, k + len(pair_open))
        if pair is None:
            return CallScan(name, arguments_so_far(pairs, complete=False), None)
        key, raw, k = pair
        pairs.append((key, typed(raw, key)))
