"""How the hidden states of dispatched rows travel: in the compute dtype, or as FP8 with scales.

The torch.distributed backends (all_to_all, allgather) send one uint8 row per token and
destination (moe_runtime/dispatch/collectives.py), the hidden-state columns first, routing metadata after.
The hidden-state columns of a row are, for hidden size H and G = ceil(H / 128):

    compute dtype:   H * itemsize bytes: x as it is
    FP8:             H bytes: float8_e4m3fn values, then 4 * G bytes: G float32 scales

(per-token-group quantization, moe_runtime/dispatch/fp8_activations.py; native byte order, as every column
in these rows). Values and scales share their row, so FP8 costs no extra message: one
all-to-all (or all-gather) per dispatch as before, and gloo, which has no float8 dtype, only
ever sees bytes. The receiver dequantizes to the compute dtype, so the expert kernel's input is
the same dtype either way. Combine (experts -> tokens) always moves the compute dtype, as
DeepEP's combine does.

Per row, FP8 moves H + 4 * ceil(H / 128) bytes instead of 2 * H for bf16 (0.52x at H = 7168)
or 4 * H for float32 (0.26x).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_runtime.dispatch.collectives import ColumnSpec
from moe_runtime.dispatch.fp8_activations import FP8_DTYPE, Fp8Activations, dequantize, num_groups, quantize_token_groups


@dataclasses.dataclass(frozen=True)
class ActivationWire:
    """The hidden-state columns of one dispatched row, for rows of `hidden_size` in `dtype`."""

    hidden_size: int
    dtype: torch.dtype    # the compute dtype: sent as is without FP8, and recv_x's dtype
    fp8: bool = False

    def specs(self) -> list[ColumnSpec]:
        """The columns `encode` produces, in order (for `unpack_rows`)."""
        if not self.fp8:
            return [ColumnSpec(self.dtype, self.hidden_size)]
        return [ColumnSpec(FP8_DTYPE, self.hidden_size),
                ColumnSpec(torch.float32, num_groups(self.hidden_size))]

    @property
    def row_bytes(self) -> int:
        """Bytes of hidden state per dispatched row."""
        return sum(spec.nbytes for spec in self.specs())

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, H] -> the columns to send, each [T, w] (compute dtype, or FP8 values + scales)."""
        if not self.fp8:
            return [x]
        quantized = quantize_token_groups(x)
        return [quantized.values, quantized.scales]

    def decode(self, columns: list[torch.Tensor]) -> torch.Tensor:
        """Received columns (as `specs` says), each [S, w] -> rows [S, H] in the compute dtype."""
        if not self.fp8:
            (rows,) = columns
            return rows
        values, scales = columns
        return dequantize(Fp8Activations(values, scales), self.dtype)
