"""JSON Schema validation that a client's schema cannot turn against the server (`SafeSchemas`).

The schemas are the request's (anyone's), and a call is checked on the event loop while the answer streams, so a
check must neither block the loop nor reach out of the process. `jsonschema` as it comes does both in places;
the validators built here differ from it as follows:

- Regular expressions (`pattern`, `patternProperties`) are not evaluated. JSON Schema's regexes are ECMA-262's
  and jsonschema runs them with Python's backtracking `re`, so a pattern such as `^(a+)+$` against a long argument
  holds the loop for minutes (ReDoS); no linear-time engine is a dependency. `pattern` passes every string,
  `patternProperties` checks nothing, `additionalProperties` next to `patternProperties` passes (which names are
  additional depends on the patterns), and `unevaluatedProperties` passes in a schema that uses
  `patternProperties` anywhere (jsonschema matches them to find the evaluated names). The check is lenient there
  and nowhere stricter than the schema.
- `format` is not evaluated (no format checker: an annotation, as JSON Schema 2020-12 makes it by default).
- `$ref` resolves inside the schema only: jsonschema's default registry would fetch an `http://` reference.
- `uniqueItems` compares canonical forms in linear time (jsonschema compares pairs of objects: quadratic).
- Every keyword evaluation is counted against a budget proportional to the arguments' size, so a schema whose
  `anyOf` / `oneOf` over a recursive `$ref` multiplies the work with every level fails instead of hanging.

The draft follows the schema's `$schema` (2020-12 without one); a schema that is not valid for its draft is
refused when the request comes (`SchemaProblem`), before anything is generated.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import referencing
from jsonschema import ValidationError, validators
from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator

BUDGET_BASE = 10_000            # keyword evaluations any check may take
BUDGET_PER_CHARACTER = 32       # and this many more per character of the arguments' JSON text


class CheckTooCostly(Exception):
    """A check went over its budget of keyword evaluations."""


class SchemaProblem(ValueError):
    """A schema that is not valid JSON Schema for its draft."""


@dataclass
class KeywordBudget:
    """Keyword evaluations left to the check in progress (checks run one at a time, on the event loop)."""

    left: int = 0

    def refill(self, arguments_chars: int) -> None:
        self.left = BUDGET_BASE + BUDGET_PER_CHARACTER * arguments_chars

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise CheckTooCostly("the check went over its budget of keyword evaluations")


def canonical(value: Any) -> Any:
    """A hashable form of a JSON value under JSON Schema's equality: 1 equals 1.0, true is no number, objects
    ignore their members' order."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", value)   # 1 == 1.0 and hash(1) == hash(1.0)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(canonical(item) for item in value))
    return ("object", frozenset((key, canonical(item)) for key, item in value.items()))


def unique_items(validator: Any, unique: Any, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if unique and isinstance(instance, list) and len({canonical(item) for item in instance}) < len(instance):
        yield ValidationError("the array's items are not unique")


def uses_pattern_properties(schema: dict) -> bool:
    """Whether `patternProperties` appears anywhere in the schema (a property of that name counts too: the
    answer only makes the check more lenient)."""
    return "patternProperties" in json.dumps(schema)


Keyword = Callable[[Any, Any, Any, dict], Any]
MESSAGE_CHARS = 300   # of a schema problem in an error message (jsonschema's quote the offending schema whole)


def shortened(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


def passes(validator: Any, value: Any, instance: Any, schema: dict) -> None:
    """A keyword that is not evaluated."""
    return None


def without_pattern_properties(additional_properties: Keyword) -> Keyword:
    def keyword(validator: Any, value: Any, instance: Any, schema: dict) -> Any:
        if "patternProperties" in schema:
            return None
        return additional_properties(validator, value, instance, schema)
    return keyword


def counted(keyword: Keyword, budget: KeywordBudget) -> Keyword:
    def counted_keyword(validator: Any, value: Any, instance: Any, schema: dict) -> Any:
        budget.spend()
        return keyword(validator, value, instance, schema)
    return counted_keyword


def safe_keywords(draft: Any, budget: KeywordBudget, skip_unevaluated_properties: bool) -> dict[str, Keyword]:
    """`draft`'s keywords with the changes the module's docstring lists, each counted against `budget`."""
    keywords = dict(draft.VALIDATORS)
    replaced: dict[str, Keyword] = {"pattern": passes, "patternProperties": passes, "uniqueItems": unique_items}
    if "additionalProperties" in keywords:
        replaced["additionalProperties"] = without_pattern_properties(keywords["additionalProperties"])
    if skip_unevaluated_properties:
        replaced["unevaluatedProperties"] = passes
    keywords.update({name: keyword for name, keyword in replaced.items() if name in keywords})
    return {name: counted(keyword, budget) for name, keyword in keywords.items()}


@dataclass
class SafeSchemas:
    """Builds the validators of one request's schemas, sharing one budget and one validator class per draft."""

    budget: KeywordBudget = field(default_factory=KeywordBudget)
    _classes: dict[tuple[Any, bool], Any] = field(default_factory=dict)

    def validator(self, schema: dict) -> Any:
        """A validator for `schema`. Raises `SchemaProblem` for a schema its draft does not allow."""
        draft = validators.validator_for(schema, default=Draft202012Validator)
        try:
            draft.check_schema(schema, format_checker=None)   # a `pattern` need not be a Python regex: never run
        except SchemaError as problem:
            where = "/".join(map(str, problem.path)) or "the top"
            raise SchemaProblem(f"{shortened(problem.message)} (at {shortened(where)})") from None
        key = (draft, uses_pattern_properties(schema))
        if key not in self._classes:
            self._classes[key] = validators.extend(draft, safe_keywords(draft, self.budget, key[1]))
        return self._classes[key](schema, registry=referencing.Registry())

    def is_valid(self, validator: Any, instance: Any, arguments_chars: int) -> bool:
        """Whether `instance` (parsed from `arguments_chars` characters of JSON) validates. A check that cannot
        finish (over budget, a `$ref` that does not resolve, recursion too deep, or anything else a hostile schema
        makes the validator raise) does not show the arguments valid."""
        self.budget.refill(arguments_chars)
        try:
            return validator.is_valid(instance)
        except Exception:   # noqa: BLE001 - see the docstring: only a finished check can accept a call
            return False
