"""From a `StructuredOutputSpec` to an xgrammar `Grammar` (parsing only: no tokenizer, milliseconds).

Both the front (to refuse a bad schema, regex or grammar before the request is accepted) and the
ranks (which then compile the grammar against the tokenizer) go through `parse_grammar`, so the two
can never disagree on what a spec means.

JSON (json_schema and json_object) is compact by default: no whitespace between elements, "," and
":" as separators (xgrammar's `any_whitespace=False`, vLLM's `disable-any-whitespace`), because a
model that prefers a whitespace token would otherwise spend its tokens on it (a forced tool call on
the demo model ran to max_tokens in whitespace). A spec with `any_whitespace` (or an engine started
with --structured-output-any-whitespace) allows it, at most `JSON_MAX_WHITESPACE` characters in a row.
json_schema follows xgrammar's strict mode, as vLLM does: properties and array items the schema does
not name are not generated (unless the schema allows them explicitly). json_object is any JSON object.

Two holes in xgrammar's JSON strings (0.2.9; its issue #800 for the first) are closed here, because
with them a strict parser (Python's json.loads) refuses the output:
- a string with minLength/maxLength is a run of `[^"\\\r\n]`, which admits raw control characters
  (a TAB, U+0003) that JSON forbids inside strings;
- its classes accept the three-byte encodings of surrogates (U+D800-U+DFFF), which are not UTF-8
  (the only invalid UTF-8 it accepts: overlong, truncated and out-of-range sequences are refused).
`valid_json_strings` rewrites both string character classes of the converted grammar to JSON's own
set without surrogates (escapes stay out of length-bounded strings, as xgrammar has them); on an
xgrammar that no longer writes these classes it changes nothing.
"""
from __future__ import annotations

import json
import re

import xgrammar

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.structured_output.spec import FIELD, StructuredOutputSpec

JSON_MAX_WHITESPACE = 16                       # characters of whitespace in a row between JSON elements
COMPACT_SEPARATORS = (",", ":")                # as json.dumps(separators=...) writes compact JSON
ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'  # parsed without strict mode: any object
XGRAMMAR_STRING_CHARACTERS = (                    # as xgrammar's EBNF prints them
    '[^\\"\\\\\\r\\n]',                                  # a length-bounded string's
    '[^\\0-\\x1f\\"\\\\\\r\\n]',                     # any other string's
)
JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'   # JSON's unescaped characters, as UTF-8 has them
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def parse_grammar(spec: StructuredOutputSpec, any_whitespace_default: bool = False) -> xgrammar.Grammar:
    """The spec's grammar; an `InvalidRequestError` naming the spec's field when xgrammar cannot read it.
    `any_whitespace_default`: whether JSON may hold whitespace when the spec does not say."""
    field = f"{FIELD}.{spec.kind}"
    any_whitespace = spec.any_whitespace if spec.any_whitespace is not None else any_whitespace_default
    whitespace = (dict(any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE) if any_whitespace else
                  dict(any_whitespace=False, separators=COMPACT_SEPARATORS))
    if spec.kind == "json_schema":
        check_json_schema_text(spec.json_schema, field)
    try:
        if spec.kind == "json_schema":
            return valid_json_strings(xgrammar.Grammar.from_json_schema(
                spec.json_schema, **whitespace, strict_mode=True))
        if spec.kind == "json_object":
            return valid_json_strings(xgrammar.Grammar.from_json_schema(
                ANY_JSON_OBJECT_SCHEMA, **whitespace, strict_mode=False))
        if spec.kind == "regex":
            return xgrammar.Grammar.from_regex(spec.regex)
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses; all mean "bad input"
        raise InvalidRequestError(f"{field}: {WHAT[spec.kind]}: {xgrammar_message(exc)}") from exc


WHAT = {
    "json_schema": "not a JSON schema xgrammar supports",
    "json_object": "xgrammar could not build the JSON grammar",
    "regex": "not a regex xgrammar supports",
    "grammar": "not an EBNF grammar xgrammar reads (GBNF syntax, with a `root` rule)",
}


def valid_json_strings(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    """The grammar with JSON's string character class wherever xgrammar wrote one of its own."""
    text = str(grammar)
    fixed = text
    for characters in XGRAMMAR_STRING_CHARACTERS:
        fixed = fixed.replace(characters, JSON_STRING_CHARACTER)
    return grammar if fixed == text else xgrammar.Grammar.from_ebnf(fixed)


def check_json_schema_text(text: str, field: str) -> None:
    """The schema must be JSON, and an object or a boolean (as JSON Schema defines)."""
    try:
        schema = json.loads(text)
    except RecursionError:   # nested past Python's recursion limit (the validator's depth bound refuses it first)
        raise InvalidRequestError(f"{field}: the schema is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{field}: a JSON schema is an object or a boolean, not {type(schema).__name__}")


def xgrammar_message(exc: Exception, limit: int = 300) -> str:
    """xgrammar's error without its C++ source location, shortened for an HTTP error body."""
    text = _XGRAMMAR_LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return text if len(text) <= limit else text[:limit] + "..."
