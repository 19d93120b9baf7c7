"""What a request asks its output to match. Exactly one kind per request.

The spec crosses the control plane inside `SamplingParams` (msgspec encodes dataclasses), so it
holds only strings and flags: the grammar itself is compiled where sampling happens, once per spec.
It is frozen and hashable: compiled grammars are cached by spec.

These checks are the spec's shape only (one kind, a string, bounded size); whether the schema,
regex or grammar is one xgrammar accepts is `StructuredOutputValidator`'s question (at the front).
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import InvalidRequestError

FIELD = "SamplingParams.structured_output"
KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    json_schema: str | None = None    # a JSON schema, serialized
    json_object: bool = False         # any JSON object
    regex: str | None = None
    grammar: str | None = None        # EBNF (GBNF-style, as xgrammar reads it; the root rule is `root`)
    any_whitespace: bool | None = None   # JSON kinds: whitespace between elements (None: the engine's default,
                                         # compact unless --structured-output-any-whitespace)

    MAX_CHARS = 64 * 1024             # a schema, regex or grammar longer than this is refused

    def __post_init__(self) -> None:
        if self.any_whitespace is not None and not isinstance(self.any_whitespace, bool):
            raise InvalidRequestError(f"{FIELD}.any_whitespace={self.any_whitespace!r:.40}: must be true or false")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"{FIELD}.json_object={self.json_object!r:.40}: must be true or false")
        kinds = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(f"{FIELD}: give exactly one of {', '.join(KINDS)} (got {kinds or 'none'})")
        text = getattr(self, kinds[0]) if kinds[0] != "json_object" else ""
        if not isinstance(text, str):
            raise InvalidRequestError(f"{FIELD}.{kinds[0]}: must be a string (got {type(text).__name__})")
        if len(text) > self.MAX_CHARS:
            raise InvalidRequestError(f"{FIELD}.{kinds[0]}: has {len(text)} characters, at most {self.MAX_CHARS}")
        if kinds[0] != "json_object" and not text.strip():
            raise InvalidRequestError(f"{FIELD}.{kinds[0]}: is empty")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None)

    @property
    def source(self) -> str:
        """The schema, regex or grammar text ("" for json_object)."""
        return "" if self.json_object else getattr(self, self.kind)
