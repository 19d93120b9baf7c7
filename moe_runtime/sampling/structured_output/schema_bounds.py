"""How deeply a JSON schema may nest, checked on its text before xgrammar (or Python's json) reads it.

xgrammar's JSON-schema conversion grows faster than the cube of the nesting depth (measured with
0.2.9: 100 levels of `{"type": "object", "properties": {"a": ...}}` parse in 0.17 s, 200 in 1.0 s,
400 in 8.9 s; the issue's 600 levels took 24.5 s), so the size bound alone (64 KiB) does not bound
the work: a 27 KB schema can hold 600 levels. The depth counted is the schema document's own JSON
nesting (objects and arrays, brackets inside strings are text), so one object-schema level with its
`properties` is two. `MAX_SCHEMA_DEPTH` = 64 leaves room for 31 such levels (OpenAI's structured
outputs allow 10), parsed in milliseconds. The scan is a loop over the text, never a recursion, so
no depth of input makes it raise `RecursionError`.
"""
from __future__ import annotations

import re
from itertools import accumulate

from moe_runtime.errors import InvalidRequestError

MAX_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_nesting_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON `text` (0 for a scalar); strings are skipped."""
    brackets = _BRACKETS.findall(_JSON_STRING.sub("", text))
    return max(accumulate(_STEP[b] for b in brackets), default=0)


def object_nesting_depth(value: object) -> int:
    """The deepest nesting of dicts and lists in a parsed JSON value (0 for a scalar), by a loop (no recursion)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_depth(text: str, field: str) -> None:
    """`InvalidRequestError` naming `field` when the schema nests deeper than `MAX_SCHEMA_DEPTH`."""
    depth = json_nesting_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"{field}: the schema is nested {depth} levels deep (objects and arrays of "
                                  f"the schema document); at most {MAX_SCHEMA_DEPTH} are accepted")
