"""Matmuls against a weight stored narrower than the compute dtype (FP8, int8), never widened whole.

`chunked_matmul` walks the weight's output rows in chunks of at most CHUNK_BYTES of fp32, has the format
widen each chunk into one scratch buffer (`RowWidener`: FP8 decodes and scales its blocks, int8 converts
and leaves its row scales for the output) and multiplies it: one row of activations through `torch.mv`
(gemv) on CPU, more through `linear_rows` (the skinny-matmul rule). The scratch buffer is reused chunk
after chunk, so a layer never holds more than CHUNK_BYTES of widened weight.

Compute dtype: fp32 on CPU whatever the activations' dtype (CPU BLAS without bf16 hardware is slower in
bf16, and fp32 keeps the product exact to the widened weight); the activations' dtype elsewhere.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .skinny_matmul import linear_rows

CHUNK_BYTES = 2 << 20    # fp32 widened weight rows held at once by one matmul


class RowWidener(Protocol):
    def __call__(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Write the weight's rows [start, stop), widened, into `out` [stop - start, K] (the scratch dtype)."""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 on CPU, the activations' dtype elsewhere."""
    return torch.float32 if x.device.type == "cpu" else x.dtype


def rows_per_chunk(in_features: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(in_features, 1)))


def chunked_matmul(x: torch.Tensor, out_features: int, widen_rows: RowWidener,
                   scratch_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] @ widened weight [out_features, K].T -> [T, out_features] in compute_dtype(x).

    `scratch_dtype`: the dtype `widen_rows` writes (default: the compute dtype)."""
    num_rows, in_features = x.shape
    dtype = compute_dtype(x)
    out = torch.empty(num_rows, out_features, dtype=dtype, device=x.device)        # [T, N]
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.zero_()
    x = x.to(dtype)
    gemv = num_rows == 1 and x.device.type == "cpu"
    chunk = min(rows_per_chunk(in_features), out_features)
    scratch = torch.empty(chunk, in_features, dtype=scratch_dtype or dtype, device=x.device)  # [chunk, K]
    for start in range(0, out_features, chunk):
        stop = min(start + chunk, out_features)
        rows = scratch[:stop - start]
        widen_rows(rows, start, stop)
        rows = rows.to(dtype)
        if gemv:
            torch.mv(rows, x[0], out=out[0, start:stop])
        else:
            out[:, start:stop] = linear_rows(x, rows)                                # [T, stop - start]
    return out
