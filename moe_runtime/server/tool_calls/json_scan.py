"""Just enough JSON to stream tool calls: where a string, a value or an object's members end in a prefix of
model output that is still growing.

A parser must tell, after every new piece of text, which part of a call's arguments is already certain
(to stream it) and whether the call is complete. `json.loads` answers neither for a prefix. These
functions do, in one pass over the text: strings (with escapes) and the nesting of objects and arrays
are tracked exactly; a scalar (number, true, false, null) ends at the first character that cannot
continue it, so one that reaches the end of the text is not known to be complete. They check structure,
not every literal: a call's arguments are still parsed and checked before it is sent
(`server.tool_calls.call_check`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
SCALAR_END = re.compile(r"[,}\] \t\n\r]")   # what ends a number, true, false or null
STRING_SPECIAL = re.compile(r'["\\]')
CONTAINER_SPECIAL = re.compile(r'["{}\[\]]')


class NotJson(ValueError):
    """The text is not JSON where JSON must be (so it is not a tool call of the expected format)."""


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """`text[i]` is the opening quote: the index after the closing one, or None if the text ends first."""
    j = i + 1
    while True:
        match = STRING_SPECIAL.search(text, j)
        if match is None:
            return None
        if match.group() == '"':
            return match.end()
        j = match.end() + 1   # skip the escaped character
        if j > len(text):
            return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at `text[i]` (no leading whitespace), or None if the text
    ends before the value is known to be complete."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return string_end(text, i)
    if first in "{[":
        depth = 0
        j = i
        while True:
            match = CONTAINER_SPECIAL.search(text, j)
            if match is None:
                return None
            char = match.group()
            if char == '"':
                end = string_end(text, match.start())
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if char in "{[" else -1
            j = match.end()
            if depth == 0:
                return j
    if first in "}],:":
        raise NotJson(f"a value cannot start with {first!r}")
    end = SCALAR_END.search(text, i)
    return end.start() if end is not None else None


@dataclass(frozen=True)
class Member:
    """One member of an object: its value spans `text[start:end]`; `end` is None while the value is incomplete."""

    start: int
    end: int | None


@dataclass(frozen=True)
class ObjectPrefix:
    """The members an object's text shows so far (the first of a repeated key wins); `end` is the index
    after its closing brace once it is complete."""

    members: dict[str, Member]
    end: int | None


def object_prefix(text: str, i: int) -> ObjectPrefix:
    """The members of the object whose `{` is at `text[i]`, as far as the text goes. Raises `NotJson` for
    text that cannot continue into an object."""
    if i >= len(text) or text[i] != "{":
        raise NotJson("expected an object")
    members: dict[str, Member] = {}
    j = skip_whitespace(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectPrefix(members, j + 1)
    while j < len(text):
        if text[j] != '"':
            raise NotJson("expected a member name")
        key_end = string_end(text, j)
        if key_end is None:
            break
        key = decoded_string(text[j:key_end])
        j = skip_whitespace(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise NotJson("expected ':' after a member name")
        j = skip_whitespace(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        members.setdefault(key, Member(j, end))
        if end is None:
            break
        j = skip_whitespace(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            return ObjectPrefix(members, j + 1)
        if text[j] != ",":
            raise NotJson("expected ',' or '}' after a member")
        j = skip_whitespace(text, j + 1)
    return ObjectPrefix(members, None)


def decoded_string(literal: str) -> str:
    """A complete JSON string literal's value. Raises `NotJson` for one JSON does not allow (a raw control
    character, a bad escape)."""
    try:
        return json.loads(literal)
    except ValueError:
        raise NotJson("not a JSON string") from None


def complete_string(text: str, member: Member | None) -> str | None:
    """The member's value if it is a complete JSON string, else None. Raises `NotJson` for a string JSON does not
    allow."""
    if member is None or member.end is None or text[member.start] != '"':
        return None
    return decoded_string(text[member.start:member.end])
