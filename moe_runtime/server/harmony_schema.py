"""A tool's JSON schema as harmony shows it to gpt-oss: a TypeScript type in the `functions` namespace.

gpt-oss was trained on tools declared as `type NAME = (_: { ... }) => any;`, with each description as a
`//` comment above its declaration and optional properties marked `?`; this writes the schema subset
tools use (objects, arrays, enums, unions, the JSON scalar types), `any` for what TypeScript cannot say.
"""
from __future__ import annotations

import json

SCALARS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}


def typescript_type(schema: object, indent: str = "") -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(json.dumps(value) for value in schema["enum"]) or "any"
    if "const" in schema:
        return json.dumps(schema["const"])
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            return " | ".join(typescript_type(option, indent) for option in schema[union]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(typescript_type({**schema, "type": one}, indent) for one in kind) or "any"
    if kind == "array":
        item = typescript_type(schema.get("items"), indent)
        return f"Array<{item}>" if " | " in item else f"{item}[]"
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "object"
        return object_type(properties, schema.get("required") or [], indent)
    return SCALARS.get(kind, "any")


def object_type(properties: dict, required: list, indent: str) -> str:
    inner = indent
    lines = ["{"]
    for name, schema in properties.items():
        schema = schema if isinstance(schema, dict) else {}
        description = schema.get("description")
        if isinstance(description, str) and description:
            lines += [f"{inner}// {line}" for line in description.splitlines()]
        optional = "" if name in required else "?"
        default = f" // default: {shown_default(schema['default'])}" if "default" in schema else ""
        lines.append(f"{inner}{name}{optional}: {typescript_type(schema, inner)},{default}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def shown_default(value: object) -> str:
    """A default as the harmony guide shows it: strings bare (`// default: celsius`), the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def function_declaration(function: dict) -> str:
    """`// description` and `type NAME = (_: {...}) => any;` (or `() => any` for a tool without parameters)."""
    lines = []
    description = function.get("description")
    if isinstance(description, str) and description:
        lines += [f"// {line}" for line in description.splitlines()]
    parameters = function.get("parameters")
    has_parameters = isinstance(parameters, dict) and parameters.get("properties")
    argument = f"_: {typescript_type(parameters)}" if has_parameters else ""
    lines.append(f"type {function['name']} = ({argument}) => any;")
    return "\n".join(lines)


def functions_namespace(tools: list[dict]) -> str:
    declarations = "\n\n".join(function_declaration(tool["function"]) for tool in tools)
    return f"## functions\n\nnamespace functions {{\n\n{declarations}\n\n}} // namespace functions"
