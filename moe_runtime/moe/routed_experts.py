"""Routing replay's array: the logical expert ids a request's tokens were (or are to be) routed to.

`[tokens, moe_layers, top_k]`: row t is position t of the sequence (prompt, then generated tokens), column l
the l-th MoE layer of the model (dense layers are not counted), and the k ids are that token's choice at
that layer, LOGICAL expert ids in [0, num_experts), never the physical slot or replica that ran them. The
dtype is the smallest that holds every id: uint8 up to 256 experts, int16 up to 32768, else int32.

`RoutedExpertsArray` is how the array travels (ranks -> front in a `TokenDelta`, front -> ranks in
`SamplingParams.forced_routed_experts`): its shape, its dtype's name and its raw little-endian bytes, no
pickle and no per-element lists; callers see a numpy array (`to_numpy`). `check_routed_experts` is the
admission check of a forced array (shape, dtype, ids in range, no id twice in one token's top-k), each
refusal naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moe_runtime.errors import InvalidRequestError

ID_DTYPES = ("uint8", "int16", "int32")
FORCED_FIELD = "forced_routed_experts"


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The smallest integer dtype holding ids [0, num_experts)."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


@dataclass(frozen=True)
class RoutingShape:
    """The model's routing: what every routed-experts array of it is shaped by."""

    num_moe_layers: int
    top_k: int
    num_experts: int
    refusal: str | None = None   # why this engine cannot record or force routing (None: it can)


@dataclass
class RoutedExpertsArray:
    """A `[tokens, moe_layers, top_k]` integer array as it travels: shape, dtype name, raw bytes."""

    shape: tuple[int, int, int]
    dtype: str                 # one of ID_DTYPES
    data: bytes                # C-order, little-endian

    @classmethod
    def of(cls, array) -> "RoutedExpertsArray":
        """From a numpy array or a torch tensor (or anything numpy reads), its dtype kept."""
        if isinstance(array, torch.Tensor):
            array = array.cpu().numpy()
        array = np.ascontiguousarray(np.asarray(array))
        if array.dtype.kind in "iu" and array.dtype.name not in ID_DTYPES and array.size and \
                np.iinfo(np.int32).min <= array.min() and array.max() <= np.iinfo(np.int32).max:
            array = array.astype(np.int32)   # a caller's int64 ids: any width it names travels as int32
        little = array.dtype.newbyteorder("<")
        return cls(tuple(int(n) for n in array.shape), array.dtype.name, array.astype(little, copy=False).tobytes())

    @classmethod
    def of_ids(cls, ids: torch.Tensor, num_experts: int) -> "RoutedExpertsArray":   # [T, L, K] integer
        """The engine's record in the smallest dtype for `num_experts`."""
        return cls.of(ids.cpu().numpy().astype(expert_id_dtype(num_experts)))

    def to_numpy(self) -> np.ndarray:
        """The array (a read-only view of the bytes); raises ValueError when shape, dtype and bytes disagree."""
        if self.dtype not in ID_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {ID_DTYPES}")
        if len(self.shape) != 3 or any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"shape {list(self.shape)} is not [tokens, moe_layers, top_k] of sizes >= 0")
        dtype = np.dtype(self.dtype).newbyteorder("<")
        expected = math.prod(self.shape) * dtype.itemsize   # exact: np.prod wraps around in int64 ("needs -2 bytes")
        if len(self.data) != expected:
            raise ValueError(f"{len(self.data)} bytes of data, shape {list(self.shape)} of {self.dtype} needs "
                             f"{expected}")
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape)


def check_routed_experts(forced: RoutedExpertsArray, routing: RoutingShape, max_tokens: int) -> np.ndarray:
    """The admission check of `SamplingParams.forced_routed_experts`: at most `max_tokens` rows (the prompt plus
    max_tokens), the model's MoE layers and top-k, ids in [0, num_experts), no id twice in a token's top-k.
    Returns the array; raises InvalidRequestError naming the field."""
    try:
        array = forced.to_numpy()
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{FORCED_FIELD}: {exc}") from None
    tokens, layers, top_k = array.shape
    if (layers, top_k) != (routing.num_moe_layers, routing.top_k):
        raise InvalidRequestError(f"{FORCED_FIELD}: shape {list(array.shape)}; this model routes "
                                  f"[tokens, {routing.num_moe_layers} MoE layers, top_k {routing.top_k}]")
    if not 1 <= tokens <= max_tokens:
        raise InvalidRequestError(f"{FORCED_FIELD}: {tokens} tokens; it covers 1 to {max_tokens} "
                                  "(the prompt plus max_tokens)")
    if array.min() < 0 or array.max() >= routing.num_experts:
        raise InvalidRequestError(f"{FORCED_FIELD}: expert ids must be in [0, {routing.num_experts}), got "
                                  f"{int(array.min())}..{int(array.max())}")
    ordered = np.sort(array, axis=-1)
    if top_k > 1 and (ordered[..., 1:] == ordered[..., :-1]).any():
        token, layer = (int(i) for i in np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(-1))[0])
        raise InvalidRequestError(f"{FORCED_FIELD}: token {token}, MoE layer {layer} names an expert twice "
                                  f"({array[token, layer].tolist()})")
    return array
