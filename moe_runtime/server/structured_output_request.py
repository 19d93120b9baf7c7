"""A request's structured-output fields -> one `StructuredOutputSpec`, checked before the request is accepted.

The fields, as OpenAI and vLLM spell them (at most one per request; two are a 400 naming the second):

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's `guided_json` (a schema, as an object or its text), `guided_regex`, `guided_grammar` (EBNF,
  GBNF syntax with a `root` rule), `guided_choice` (one of a list of strings);
- vLLM's `structured_outputs`: {"json" | "json_object" | "regex" | "grammar" | "choice": ...}, with
  vLLM's `disable_any_whitespace` (false: JSON may hold whitespace between elements; unset: the
  server's default, compact unless `--structured-output-any-whitespace`).

Whether xgrammar can read the schema, regex or grammar is checked here, in the request's conversion
thread (off the event loop), with the server's `StructuredOutputValidator` (parsed once per spec):
a bad one is a 400 whose `param` is the field that carried it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.structured_output.spec import FIELD, StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator
from moe_runtime.server.errors import bad_request
from moe_runtime.server.protocol import SamplingFields

MAX_CHOICES = 256


def schema_spec(schema: dict | bool | str) -> StructuredOutputSpec:
    """A schema given as an object (or true/false) is serialized; one given as text is kept as it is. The
    body's parser took the object, but serializing it recurses too: one nested near the recursion limit is
    refused here (the validator refuses any schema deeper than its depth bound in any case)."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise InvalidRequestError("the schema is nested too deeply") from None
    return StructuredOutputSpec(json_schema=text)


def choice_spec(choices: list[str]) -> StructuredOutputSpec:
    """An EBNF grammar whose root is one of `choices`, each a JSON-escaped string literal (xgrammar reads those)."""
    if not choices or len(choices) > MAX_CHOICES or any(not choice for choice in choices):
        raise InvalidRequestError(f"give 1 to {MAX_CHOICES} non-empty strings (got {len(choices)} choices)")
    return StructuredOutputSpec(grammar="root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


VLLM_KINDS: dict[str, Callable[[object], StructuredOutputSpec]] = {   # structured_outputs.<kind>
    "json": schema_spec,
    "json_object": lambda _: StructuredOutputSpec(json_object=True),
    "regex": lambda regex: StructuredOutputSpec(regex=regex),
    "grammar": lambda grammar: StructuredOutputSpec(grammar=grammar),
    "choice": choice_spec,
}


@dataclass(frozen=True)
class Candidate:
    param: str                                   # the API field that asks for it
    build: Callable[[], StructuredOutputSpec]    # raises InvalidRequestError for a malformed value


def requested_structure(request: SamplingFields, validator: StructuredOutputValidator) -> StructuredOutputSpec | None:
    """The request's constraint on its output (None: free text); a 400 naming the field if it is unusable."""
    candidates = _candidates(request)
    if len(candidates) > 1:
        raise bad_request(f"{candidates[1].param} cannot be combined with {candidates[0].param}: give one "
                          f"structured-output field", candidates[1].param)
    if not candidates:
        return None
    chosen = candidates[0]
    try:
        spec = chosen.build()
        validator.check(spec)
    except InvalidRequestError as exc:
        raise bad_request(f"{chosen.param}: {_without_engine_field(str(exc))}", chosen.param) from exc
    return spec


def _candidates(request: SamplingFields) -> list[Candidate]:
    """Every structured-output field the request sets, in a fixed order."""
    found: list[Candidate] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(Candidate("response_format", lambda: StructuredOutputSpec(json_object=True)))
    elif response_format is not None and response_format.type == "json_schema":
        given = response_format.json_schema
        if given is None or given.schema_ is None:
            raise bad_request('response_format of type "json_schema" needs json_schema.schema',
                              "response_format.json_schema")
        found.append(Candidate("response_format.json_schema.schema", lambda: schema_spec(given.schema_)))
    if request.guided_json is not None:
        found.append(Candidate("guided_json", lambda: schema_spec(request.guided_json)))
    if request.guided_regex is not None:
        found.append(Candidate("guided_regex", lambda: StructuredOutputSpec(regex=request.guided_regex)))
    if request.guided_grammar is not None:
        found.append(Candidate("guided_grammar", lambda: StructuredOutputSpec(grammar=request.guided_grammar)))
    if request.guided_choice is not None:
        found.append(Candidate("guided_choice", lambda: choice_spec(request.guided_choice)))
    outputs = request.structured_outputs
    if outputs is not None:
        fields = (("json", outputs.json_), ("json_object", outputs.json_object or None), ("regex", outputs.regex),
                  ("grammar", outputs.grammar), ("choice", outputs.choice))
        given_kinds = {kind: value for kind, value in fields if value is not None}
        if len(given_kinds) != 1:
            raise bad_request(f"structured_outputs: give exactly one of {', '.join(VLLM_KINDS)} "
                              f"(got {sorted(given_kinds) or 'none'})", "structured_outputs")
        (kind, value), = given_kinds.items()
        whitespace = None if outputs.disable_any_whitespace is None else not outputs.disable_any_whitespace
        found.append(Candidate(f"structured_outputs.{kind}",
                               lambda: dataclasses.replace(VLLM_KINDS[kind](value), any_whitespace=whitespace)))
    return found


def _without_engine_field(message: str) -> str:
    """The engine names its own field (`SamplingParams.structured_output.regex: ...`); the API names its own."""
    if message.startswith(FIELD):
        return message.partition(": ")[2] or message
    return message
