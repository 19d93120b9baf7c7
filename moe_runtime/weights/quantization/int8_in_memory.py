"""`--quantization int8`: linear and expert weights kept int8 in memory, one fp32 scale per output row.

Symmetric per-output-channel quantization at load: scale[n] = max_k |w[n, k]| / 127 and
values = round(w / scale) in [-127, 127] (a row of zeros gets scale 1). Whatever the checkpoint
holds is read in its float form first (an FP8 checkpoint's blocks dequantized by the reader), then
quantized, so one path serves fp32, bf16 and FP8 checkpoints.

A row scale covers the whole row, so a tensor-parallel shard is cut from the quantized weight: a row
shard (column parallel) quantizes only its rows, a column shard (row parallel) quantizes the whole
weight and keeps its columns with the full rows' scales. Every shard fits (`fits_columns`), and the
ranks' partial sums add up to the unsharded int8 product: tp = 2 computes what tp = 1 does, up to
summation order. The kernels are the family's `int8_linear`, `int8_expert_mlp`,
`int8_masked_expert_mlp` (moe_runtime/kernels/int8_weights.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_runtime.kernels import KernelSet
from moe_runtime.kernels.int8_weights import INT8_MAX
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, TensorSource


def quantize_int8_rows(weight: torch.Tensor) -> QuantizedRows:
    """weight [..., N, K] (any float dtype) -> int8 values [..., N, K] and float32 scales [..., N]."""
    w = weight.float()
    amax = w.abs().amax(dim=-1) if w.shape[-1] else w.new_zeros(w.shape[:-1])
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))     # [..., N]
    values = torch.round(w / scales.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedRows(values, scales.contiguous())


@dataclass(frozen=True)
class Int8InMemory:
    """A `WeightQuantization`: int8 values [N, K], float32 scales [N]."""

    kernels: KernelSet
    name: ClassVar[str] = "int8"
    values_dtype: ClassVar[torch.dtype] = torch.int8
    scales_dtype: ClassVar[torch.dtype] = torch.float32
    experts_only: ClassVar[bool] = False
    expert_epilogue: ClassVar[bool] = False     # its expert kernels are bias-free SiLU
    column_groups: ClassVar[bool] = False      # no per-column groups (int4 act order's)

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, columns)

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows,)

    def fits_columns(self, start: int, stop: int, total: int) -> bool:
        return True    # one scale per row: any column cut keeps it (module docstring)

    def quantize(self, weight: torch.Tensor) -> QuantizedRows:
        return quantize_int8_rows(weight)

    def read(self, reader: TensorSource, name: str) -> QuantizedRows:
        return quantize_int8_rows(reader.read(name))

    def read_slice(self, reader: TensorSource, name: str, dim: int, start: int, stop: int) -> QuantizedRows:
        if dim == 0:   # rows are quantized independently: only these rows need reading
            return quantize_int8_rows(reader.read_slice(name, 0, start, stop))
        whole = self.read(reader, name)                 # the whole rows' scales, then the columns
        return QuantizedRows(whole.values[:, start:stop], whole.scales)

    def plan(self, values, scales) -> None:
        """Nothing to decide per weight."""
        return None

    def linear(self, x, values, scales, bias=None, plan=None):
        return self.kernels.int8_linear(x, values, scales, bias)

    def expert_mlp(self, masked, x, counts, w13, w13_scale, w2, w2_scale):
        kernel = self.kernels.int8_masked_expert_mlp if masked else self.kernels.int8_expert_mlp
        return kernel(x, counts, w13, w13_scale, w2, w2_scale)
