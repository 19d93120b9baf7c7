"""The front's check of a structured-output spec: can xgrammar read it? Parsed once per spec, cached.

A request whose schema, regex or grammar xgrammar cannot read is refused at admission with an
`InvalidRequestError` naming the field, never accepted and failed later on the ranks. Parsing
needs no tokenizer and takes about a millisecond for an ordinary schema (tens for one at the 64 KiB
limit); the answer, good or bad, is cached by spec, so a client repeating a spec costs a lookup.
A JSON schema nested deeper than `schema_bounds.MAX_SCHEMA_DEPTH` is refused before xgrammar reads
it (its conversion time grows with the cube of the depth; see `schema_bounds`).
"""
from __future__ import annotations

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.structured_output.grammar_parsing import parse_grammar
from moe_runtime.sampling.structured_output.lru import BoundedLRU
from moe_runtime.sampling.structured_output.schema_bounds import check_schema_depth
from moe_runtime.sampling.structured_output.spec import FIELD, StructuredOutputSpec

VALID = ""   # the cached verdict of a spec that parsed (a refusal caches its message)


class StructuredOutputValidator:
    def __init__(self, max_entries: int = 1024):
        self._verdicts: BoundedLRU[StructuredOutputSpec, str] = BoundedLRU(max_entries)

    def check(self, spec: StructuredOutputSpec) -> None:
        """`InvalidRequestError` naming `SamplingParams.structured_output.<kind>` if xgrammar cannot read it."""
        verdict = self._verdicts.get(spec)
        if verdict is None:
            try:
                if spec.kind == "json_schema":
                    check_schema_depth(spec.json_schema, f"{FIELD}.json_schema")
                parse_grammar(spec)
                verdict = VALID
            except InvalidRequestError as exc:
                verdict = str(exc)
            self._verdicts.put(spec, verdict)
        if verdict != VALID:
            raise InvalidRequestError(verdict)

    def __len__(self) -> int:
        return len(self._verdicts)
