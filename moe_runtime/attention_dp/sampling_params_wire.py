"""A request's `SamplingParams` on the control plane: only the fields it sets.

msgspec writes a dataclass field by field, defaults included: every `AddRequest` carried all of
`SamplingParams`' names and values (~320 bytes) whatever the request asked for, and each field added to it
(routing replay's `return_routed_experts` / `forced_routed_experts`) grew every request's message. The wire
form is a msgspec Struct built from the dataclass itself (its fields, declared types and defaults, so a field
added there travels without an edit here) with `omit_defaults`: a field at its default is not written and
decodes to that default. Decoding checks each value against its declared type, as decoding the dataclass
did, and building the `SamplingParams` runs its `__post_init__` (normalization only, idempotent).
"""
from __future__ import annotations

import dataclasses
import typing

import msgspec

from moe_runtime.sampling.params import SamplingParams


def _wire_type() -> type[msgspec.Struct]:
    hints = typing.get_type_hints(SamplingParams)   # the declared types (the module's annotations are strings)
    fields = []
    for field in dataclasses.fields(SamplingParams):
        if field.default is not dataclasses.MISSING:
            default = field.default
        else:   # list / dict factories: an empty one is omitted too
            default = msgspec.field(default_factory=field.default_factory)
        fields.append((field.name, hints[field.name], default))
    return msgspec.defstruct("SamplingParamsWire", fields, kw_only=True, omit_defaults=True)


SamplingParamsWire = _wire_type()


def params_to_wire(params: SamplingParams) -> msgspec.Struct:
    """`params` as a `SamplingParamsWire` (the same values; only those off their defaults get written)."""
    return SamplingParamsWire(**{field.name: getattr(params, field.name)
                                 for field in dataclasses.fields(SamplingParams)})


def params_from_wire(wire: msgspec.Struct) -> SamplingParams:
    """The `SamplingParams` a decoded `SamplingParamsWire` carries."""
    return SamplingParams(**msgspec.structs.asdict(wire))
