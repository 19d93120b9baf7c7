"""What decides whether a call a parser found may leave the server as a tool call (`CallCheck`).

A call that fails its check is not a tool call: the stream gives its text as content
(`server.tool_calls.stream`). The request's check is `server.tool_calls.offered_tools.OfferedTools` (the name
must be offered, the arguments must match its schema); without tools to check against (a stream built on its
own, or harmony without the request's tools) `ANY_OBJECT_ARGUMENTS` still keeps out what no client can use.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


class CallCheck(Protocol):
    def accepts(self, name: str, arguments: str) -> bool:
        """Whether the call `name(arguments)` (the arguments' JSON text) may be sent as a tool call."""
        ...


def refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def arguments_object(arguments: str) -> dict | None:
    """The arguments as a dict, or None unless `arguments` is one strict JSON object that a response can carry.

    Strict: Python's `json` reads NaN and Infinity, which JSON has not (a client's parser would fail on them).
    A lone surrogate in the text (GLM's and MiniMax's values are re-serialized from decoded JSON, where `\\ud800`
    becomes one) cannot be encoded as UTF-8, so the response could not be written. Integers longer than Python
    reads (4300 digits) and nesting deeper than it recurses fail as well."""
    try:
        arguments.encode("utf-8")
        value = json.loads(arguments, parse_constant=refuse_constant)
    except (ValueError, RecursionError):   # UnicodeEncodeError and JSONDecodeError are ValueErrors
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class AnyObjectArguments:
    """Any named call whose arguments are a JSON object: all that can be checked without the request's tools."""

    def accepts(self, name: str, arguments: str) -> bool:
        return bool(name) and arguments_object(arguments) is not None


ANY_OBJECT_ARGUMENTS = AnyObjectArguments()
