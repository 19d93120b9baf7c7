"""The check of one request's tool calls (`OfferedTools`): a call leaves the server only if it names a function
the request offered and its arguments are a JSON object that validates against that function's `parameters`.

Built once per request, while the request is converted (off the event loop): every schema is checked and its
validator made there, so checking a call as the answer streams is one validation (`server.tool_calls.safe_schema`
keeps that bounded whatever the schema).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from moe_runtime.server.errors import bad_request
from moe_runtime.server.protocol import ToolDefinition
from moe_runtime.server.tool_calls.call_check import arguments_object
from moe_runtime.server.tool_calls.forced_schema import NO_PARAMETERS
from moe_runtime.server.tool_calls.safe_schema import SafeSchemas, SchemaProblem


def parameters_schema(tool: ToolDefinition) -> dict:
    """The schema a function's arguments must match. Without `parameters` it takes no arguments: only `{}` (OpenAI:
    "Omitting parameters defines a function with an empty parameter list"; the forced schema says the same), not
    any object: a model that invents arguments for such a function has misread it."""
    parameters = tool.function.parameters
    return NO_PARAMETERS if parameters is None else parameters


@dataclass(frozen=True)
class OfferedTools:
    validators: Mapping[str, Any]   # function name -> its arguments' validator (the first of a repeated name)
    schemas: SafeSchemas

    @classmethod
    def of(cls, tools: list[ToolDefinition]) -> "OfferedTools":
        """Raises a 400 naming the tool whose `parameters` is not a valid JSON Schema."""
        schemas = SafeSchemas()
        found: dict[str, Any] = {}
        for index, tool in enumerate(tools):
            try:
                validator = schemas.validator(parameters_schema(tool))
            except SchemaProblem as problem:
                raise bad_request(f"tools[{index}] ({tool.function.name!r}): its parameters are not a valid JSON "
                                  f"Schema: {problem}", f"tools.{index}.function.parameters") from None
            found.setdefault(tool.function.name, validator)
        return cls(MappingProxyType(found), schemas)

    def accepts(self, name: str, arguments: str) -> bool:
        validator = self.validators.get(name)
        if validator is None:
            return False
        instance = arguments_object(arguments)
        return instance is not None and self.schemas.is_valid(validator, instance, len(arguments))
