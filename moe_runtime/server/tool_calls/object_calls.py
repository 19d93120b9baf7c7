"""Calls written as JSON objects, `{"name": ..., "arguments": {...}}`: alone (Hermes) or as the elements of
an array (Mistral's `[TOOL_CALLS][...]`, and the forced output of `tool_choice` required/named)."""
from __future__ import annotations

from moe_runtime.server.tool_calls.json_scan import Member, NotJson, complete_string, object_prefix, skip_whitespace
from moe_runtime.server.tool_calls.parser import PENDING_CALL, CallScan

ARGUMENT_KEYS = ("arguments", "parameters")   # some models write "parameters"


def call_in_object(text: str, start: int) -> CallScan:
    """The call whose object opens at `text[start]`; its `end` is the index after the object's `}`."""
    found = object_prefix(text, start)
    name = complete_string(text, found.members.get("name"))
    member = next((member for key, member in found.members.items() if key in ARGUMENT_KEYS), None)   # the first
    return CallScan(name, arguments_text(text, member), found.end)


def arguments_text(text: str, member: Member | None) -> str:
    """The arguments' JSON text known so far: an object streams as it grows; a JSON string holding the
    arguments (some models quote them) counts once complete; any other value counts as written once complete
    (not an object, it fails the call's check)."""
    if member is None:
        return ""
    if text[member.start] == "{":
        return text[member.start:member.end if member.end is not None else len(text)]
    if text[member.start] == '"':
        decoded = complete_string(text, member)
        return decoded if decoded is not None else ""
    return text[member.start:member.end] if member.end is not None else ""


def call_in_array(text: str, pos: int, final: bool) -> CallScan | None:
    """The array element at `pos`: `[` opens the first, `,` each later one, `]` ends the array (None)."""
    i = skip_whitespace(text, pos)
    if i >= len(text):
        return None if final else PENDING_CALL
    if text[i] == "]":
        return None
    if text[i] not in "[,":
        raise NotJson("expected '[', ',' or ']' around the calls")
    j = skip_whitespace(text, i + 1)
    if j >= len(text):
        return None if final else PENDING_CALL
    if text[j] == "]":
        return None
    return call_in_object(text, j)

