"""What a request asks its output to match. Exactly one kind per request.

The spec crosses the control plane inside `SamplingParams` (msgspec encodes dataclasses), so it
holds only strings and flags: the grammar itself is compiled where sampling happens, once per spec.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputSpec:
    json_schema: str | None = None    # a JSON schema, serialized
    json_object: bool = False         # any JSON object
    regex: str | None = None
    grammar: str | None = None        # EBNF (GBNF-style, as xgrammar reads it)

    MAX_CHARS = 64 * 1024             # a schema, regex or grammar longer than this is refused

    def __post_init__(self) -> None:
        kinds = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(f"structured output: give exactly one of json_schema, json_object, regex, "
                                      f"grammar (got {kinds or 'none'})")
        text = getattr(self, kinds[0]) if kinds[0] != "json_object" else ""
        if not isinstance(text, str):
            raise InvalidRequestError(f"structured output: {kinds[0]} must be a string")
        if len(text) > self.MAX_CHARS:
            raise InvalidRequestError(f"structured output: {kinds[0]} has {len(text)} characters, at most "
                                      f"{self.MAX_CHARS}")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None)
