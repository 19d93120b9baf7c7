"""Which request field a JSON body's parse failure lies in, so that its 400 can name it.

`json.loads` gives up without saying where in two cases: a body nested deeper than Python's recursion
limit (RecursionError, about 1,000 levels: a schema of nested arrays does it in 12 KB) and an integer
literal longer than Python converts (ValueError, 4,300 digits). A scan of the text finds the top-level
field that holds the deepest nesting, or the first such literal. It is a loop over the tokens, never a
recursion, so no input makes it fail the way the parser did; it runs only after such a failure.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterator

# a string (escapes included), a bracket, a colon, or an integer literal (not the start of a fraction or exponent)
_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"|[{}\[\]:]|-?\d++(?![.eE])', re.DOTALL)


@dataclass(frozen=True)
class Found:
    field: str | None      # the top-level field (None: the body itself)
    amount: int            # the depth reached, or the literal's digits


def _tokens(text: str) -> Iterator[tuple[str | None, int, str]]:
    """(the top-level field, the depth, the token) for each token of a JSON object's text."""
    depth, field, last_string = 0, None, None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth <= 1:
                last_string = None
        elif token == ":":
            if depth == 1 and last_string is not None:
                field = _key(last_string)
        elif token.startswith('"'):
            last_string = token
        yield field if depth >= 1 else None, depth, token


def _key(quoted: str) -> str:
    try:
        return json.loads(quoted)
    except ValueError:
        return quoted[1:-1]


def deepest_field(text: str) -> Found:
    """The top-level field where the text nests deepest (the first such), and that depth."""
    found = Found(None, 0)
    for field, depth, _ in _tokens(text):
        if depth > found.amount:
            found = Found(field, depth)
    return found


def long_integer_field(text: str, max_digits: int) -> Found | None:
    """The top-level field of the first integer literal of more than `max_digits` digits, and its digits."""
    for field, _, token in _tokens(text):
        digits = len(token.lstrip("-"))
        if token[-1].isdigit() and not token.startswith('"') and digits > max_digits:
            return Found(field, digits)
    return None
