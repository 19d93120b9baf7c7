"""JSON request bodies: read, parsed and validated into their pydantic model, large ones off the event loop.

Routes take `body: Model = Depends(json_body(Model))` instead of FastAPI's own body parameter, which
parses and validates on the event loop and calls an empty body "missing required parameter None".
Every refusal is a 400 that says what is wrong with the body: empty, not JSON, not a JSON object,
text that is not valid Unicode (a lone surrogate escape such as "\\ud800", which no tokenizer can
take), or the first invalid field. A body nested past the parser's recursion limit, or holding an
integer of more than 4,300 digits, is refused naming the field that holds it (`server.json_failure_field`).

json and pydantic-core hold the GIL while they run, so a worker thread lets the event loop in
between the steps of a large body rather than during each; the request-size limit bounds the rest.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Awaitable, Callable, Iterable, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from moe_runtime.server.errors import APIError, bad_request, validation_error
from moe_runtime.server.json_failure_field import deepest_field, long_integer_field

Model = TypeVar("Model", bound=BaseModel)

INLINE_PARSE_BYTES = 64 * 1024   # smaller bodies are parsed in place: a thread hop would cost more


def json_body(model: type[Model]) -> Callable[[Request], Awaitable[Model]]:
    """A FastAPI dependency reading the request body as a `model`."""

    async def read_json_body(request: Request) -> Model:
        raw = await request.body()
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse_body(raw, model)
        return await asyncio.to_thread(parse_body, raw, model)

    return read_json_body


def parse_body(raw: bytes, model: type[Model]) -> Model:
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object (Content-Type: application/json)",
                       "invalid_request_error", None, "missing_body")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text: send a JSON object", code="invalid_json") from None
    except RecursionError:
        raise too_deep(raw) from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc.msg}", code="invalid_json") from None
    except ValueError:   # an integer literal of more digits than Python converts
        raise too_long_integer(raw) from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {json_kind(data)}", code="invalid_body")
    if b"\\ud" in raw or b"\\uD" in raw:   # the only way a lone surrogate gets into decoded JSON
        param = lone_surrogate_path(data)
        if param is not None:
            raise bad_request(f"{param} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): "
                              "text must be valid Unicode", param, "invalid_unicode")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def too_deep(raw: bytes) -> APIError:
    """The 400 for a body nested past the parser's recursion limit, naming the field that nests so deep."""
    found = deepest_field(raw.decode("utf-8", "replace"))
    where = found.field if found.field is not None else "the body"
    return bad_request(f"{where} is nested too deeply ({found.amount} levels of objects and arrays): malformed JSON "
                       "body", found.field, "invalid_json")


def too_long_integer(raw: bytes) -> APIError:
    """The 400 for an integer literal longer than Python converts, naming the field that holds it."""
    limit = sys.get_int_max_str_digits()
    found = long_integer_field(raw.decode("utf-8", "replace"), limit)
    if found is None:
        return bad_request(f"malformed JSON body: an integer literal of more than {limit} digits", code="invalid_json")
    where = found.field if found.field is not None else "the body"
    return bad_request(f"{where} holds an integer of {found.amount} digits, more than {limit}: malformed JSON body",
                       found.field, "invalid_json")


def json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"


def is_valid_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (what json.loads makes of "\\ud800"); UTF-8 cannot encode it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(data: dict) -> str | None:
    """The dotted path ("messages.0.content") of the first string holding a lone surrogate, or None."""
    pending: list[tuple[object, tuple]] = [(data, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if not is_valid_unicode(value):
                return ".".join(str(part) for part in path)
        elif isinstance(value, dict):
            for key in value:
                if not is_valid_unicode(key):   # never quoted back: it could not be sent as JSON
                    return f"{'.'.join(str(part) for part in path) or 'the body'} (a field name)"
            pending.extend((item, (*path, key)) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((item, (*path, i)) for i, item in reversed(list(enumerate(value))))
    return None


def documented_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route reading `json_body(model)`: the schema FastAPI would have shown."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_body_schemas(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Add the models `documented_body` refers to to the app's OpenAPI components."""
    models = list(models)
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        return schema

    app.openapi = openapi
