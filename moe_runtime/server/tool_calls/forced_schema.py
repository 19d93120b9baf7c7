"""The JSON schema that forces tool calls through structured output (`tool_choice` required or named).

The answer must be a JSON array of `{"name": NAME, "arguments": ARGS}` objects, where NAME is a
tool's name (a `const`) and ARGS matches that tool's `parameters` schema; `required` allows any of the
tools (`anyOf`) and up to `max_calls` calls, a named choice exactly one call of that function. Name
comes first in each object, so a streamed call can be announced before its arguments.
"""
from __future__ import annotations

import json

from moe_runtime.server.protocol import ToolDefinition

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}   # a function without parameters


def call_schema(tool: ToolDefinition) -> dict:
    function = tool.function
    return {
        "type": "object",
        "properties": {"name": {"const": function.name},
                       "arguments": function.parameters if function.parameters is not None else NO_PARAMETERS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def calls_schema(tools: list[ToolDefinition], max_calls: int) -> str:
    """Serialized (compact): `StructuredOutputSpec.json_schema` takes text."""
    schemas = [call_schema(tool) for tool in tools]
    item = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {"type": "array", "items": item, "minItems": 1, "maxItems": max_calls}
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
