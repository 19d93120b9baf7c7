"""Routing replay's arrays in JSON: `{"shape": [T, L, K], "dtype": "uint8", "data": "<base64>"}`.

The same object in both directions: each choice of a request with `return_routed_experts: true` carries its
array as `routed_experts` (in a streamed call, the whole array in the choice's final chunk, the one with its
finish_reason); a request's `forced_routed_experts` is read the same way. The data is base64 of the array's
little-endian C-order bytes (moe/routed_experts.py), what numpy reads back with
`np.frombuffer(base64.b64decode(data), dtype).reshape(shape)`.
"""
from __future__ import annotations

import base64
import binascii
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from moe_runtime.moe.routed_experts import RoutedExpertsArray


class RoutedExpertsJSON(BaseModel):
    shape: list[int] = Field(min_length=3, max_length=3)
    dtype: Literal["uint8", "int16", "int32"]
    data: str

    @classmethod
    def of(cls, array: np.ndarray | None) -> "RoutedExpertsJSON | None":
        if array is None:
            return None
        wire = RoutedExpertsArray.of(array)
        return cls(shape=list(wire.shape), dtype=wire.dtype, data=base64.b64encode(wire.data).decode("ascii"))

    def to_array(self) -> RoutedExpertsArray:
        """The engine's form; raises ValueError when the data is no base64 (the admission check then judges the
        shape, dtype, size and ids)."""
        try:
            data = base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("data is not base64") from None
        return RoutedExpertsArray(tuple(self.shape), self.dtype, data)
