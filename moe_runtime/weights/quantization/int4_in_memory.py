"""`--quantization int4`: routed experts kept as packed int4 codes with float32 group scales, decoded per matmul chunk.

Layout: moe_runtime/kernels/int4_layout.py (`Int4Layout`): values uint8 [N, ceil(K/2)], scales float32 [N, G] or,
with zero points, [N, G, 2]; with act order (GPTQ's `desc_act`) also the group of each input column, int32 [K]
(`Int4Rows.column_groups`), which an expert stack keeps per slot (`ExpertWeights.w13_groups` / `w2_groups`). One
engine keeps one layout: an int4 checkpoint's own (compressed-tensors pack-quantized, AWQ, GPTQ: its expert tensors
read as stored through the reader's `read_int4`), or `DEFAULT_INT4_LAYOUT` for a float checkpoint, whose experts
are then quantized at load (`quantize_int4`, lossy: 4 bits a weight plus a scale per 128 columns, about a quarter
of bf16's bytes).

Rounding at load (`quantize_int4`), per group of input columns, nearest code:
- symmetric: scale = max |w| / 7, code = clamp(round(w / scale) + 8, 0, 15): the largest magnitude is exactly +-7
  steps (codes 1..15; code 0, -8 steps, is never produced), every weight within half a step;
- zero points: lo = min(min w, 0), hi = max(max w, 0), scale = (hi - lo) / 15, zero = clamp(round(-lo / scale),
  0, 15), code = clamp(round(w / scale) + zero, 0, 15): within a step (the zero point's rounding may push an end
  by half a step into the clamp);
a group of zeros gets scale 1. A layout with column groups quantizes contiguous groups and names them
(`Int4Layout.column_groups_of`).

Experts only (`experts_only`), as int4 releases quantize them: attention, routers, dense MLPs, shared experts and
the LM head stay in the compute dtype (an int4 checkpoint's other int4 layers are dequantized at load by the
reader). `linear` exists all the same for a layout without column groups. The expert kernels are bias-free SiLU
(`expert_epilogue` False): the family's `int4_expert_mlp`, `int4_masked_expert_mlp`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels import KernelSet
from moe_runtime.kernels.int4_layout import (INT4_CODES, SYMMETRIC_ZERO, Int4Layout, Int4Weight, check_int4_weight,
                                             pack_int4, packed_int4_columns)
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, TensorSource

DEFAULT_INT4_LAYOUT = Int4Layout(group_size=128, zero_points=False)   # a float checkpoint's experts, at load
INT4_MAX_STEPS = 7             # symmetric: the largest magnitude of a group is 7 steps from the zero point
INT4_LEVELS = INT4_CODES - 1   # zero points: 15 steps between a group's low and high end


@dataclass(frozen=True)
class Int4Rows(QuantizedRows):
    """An int4 weight's rows: values and scales as `QuantizedRows`, and act order's column groups int32 [K] (None for
    contiguous groups), which a row cut keeps whole."""

    column_groups: torch.Tensor | None = None


def quantize_int4(weight: torch.Tensor, layout: Int4Layout) -> Int4Weight:
    """weight [..., N, K] (any float dtype) -> an `Int4Weight` in `layout`, rounded to nearest (module docstring)."""
    columns = weight.shape[-1]
    groups = layout.groups(columns)
    size = columns if layout.group_size is None else layout.group_size
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, groups * size - columns)).unflatten(-1, (groups, max(size, 1)))
    if layout.zero_points:                       # zeros padding the last group change neither end
        low = padded.amin(dim=-1).clamp(max=0.0)
        high = padded.amax(dim=-1).clamp(min=0.0)                           # [..., N, G]
        steps = high - low
        scale = torch.where(steps > 0, steps / INT4_LEVELS, torch.ones_like(steps))
        zero = torch.round(-low / scale).clamp_(0, INT4_LEVELS)
    else:
        amax = padded.abs().amax(dim=-1)                                    # [..., N, G]
        scale = torch.where(amax > 0, amax / INT4_MAX_STEPS, torch.ones_like(amax))
        zero = torch.full_like(scale, float(SYMMETRIC_ZERO))
    codes = (torch.round(padded / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp_(0, INT4_LEVELS)
    values = pack_int4(codes.flatten(-2)[..., :columns].to(torch.uint8))
    scales = torch.stack((scale, zero), dim=-1) if layout.zero_points else scale
    column_groups = None
    if layout.column_groups:
        column_groups = layout.column_groups_of(columns).to(weight.device).expand(*weight.shape[:-2], columns)
    return Int4Weight(values, scales.contiguous(), columns,
                      None if column_groups is None else column_groups.contiguous())


def int4_rows(weight: Int4Weight) -> Int4Rows:
    return Int4Rows(weight.values, weight.scales, weight.column_groups)


@dataclass(frozen=True)
class Int4InMemory:
    """A `WeightQuantization`: packed int4 codes uint8 [N, ceil(K/2)] with float32 group scales, in one `layout`."""

    kernels: KernelSet    # int4_linear, int4_expert_mlp, int4_masked_expert_mlp
    layout: Int4Layout = DEFAULT_INT4_LAYOUT
    # False where int4 was not asked for but kept as an int4 release ships its experts (quantization_choice.py):
    # an expert weight the release stores in float is then refused by name, not rounded (lossy) behind its back
    rounds_float_weights: bool = True
    name: ClassVar[str] = "int4"
    values_dtype: ClassVar[torch.dtype] = torch.uint8
    scales_dtype: ClassVar[torch.dtype] = torch.float32
    experts_only: ClassVar[bool] = True
    expert_epilogue: ClassVar[bool] = False     # its expert kernels are bias-free SiLU

    @property
    def column_groups(self) -> bool:
        """Whether each weight carries its columns' groups (act order): expert stacks keep them per slot."""
        return self.layout.column_groups

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return self.layout.values_shape(rows, columns)

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return self.layout.scale_shape(rows, columns)

    def fits_columns(self, start: int, stop: int, total: int) -> bool:
        """A column shard keeps whole groups and whole bytes (act order's scattered groups: never)."""
        if self.layout.column_groups or start % 2:
            return False
        if self.layout.group_size is None:
            return True     # one scale per row covers any columns of it
        size = self.layout.group_size
        return start % size == 0 and (stop % size == 0 or stop == total)

    def quantize(self, weight: torch.Tensor) -> Int4Rows:
        return int4_rows(quantize_int4(weight, self.layout))

    def read(self, reader: TensorSource, name: str) -> Int4Rows:
        """A whole weight [N, K]: an int4 checkpoint's as stored (`read_int4`), any other quantized at load."""
        stored = reader.read_int4(name)
        if stored is None:
            return self.quantize(self._float_weight(reader, name).read(name))
        check_int4_weight(self.layout, stored.values, stored.scales, stored.columns, stored.column_groups, name)
        return int4_rows(stored)

    def read_slice(self, reader: TensorSource, name: str, dim: int, start: int, stop: int) -> Int4Rows:
        if dim == 0:
            stored = reader.read_int4(name)
            if stored is None:                  # rows are quantized independently: only these rows need reading
                return self.quantize(self._float_weight(reader, name).read_slice(name, 0, start, stop))
            return self.read(reader, name).rows(start, stop)
        whole = self.read(reader, name)         # whole groups of columns (`fits_columns`)
        first_group = 0 if self.layout.group_size is None else start // self.layout.group_size
        last_group = 1 if self.layout.group_size is None else self.layout.groups(stop)
        return Int4Rows(whole.values[:, start // 2:packed_int4_columns(stop)],
                        whole.scales[:, first_group:last_group])

    def _float_weight(self, reader: TensorSource, name: str) -> TensorSource:
        """`reader`, where a weight stored in float may be rounded to int4 here: where int4 was asked for, and for
        an update's float tensors (a trainer's, kept in the release's int4 layout as FP8 and int8 are kept)."""
        if not self.rounds_float_weights and not reader.plain_tensors:
            raise CheckpointError(f"{name}: this routed-expert weight is stored unquantized while the release's other "
                                  f"routed experts are int4 (kept packed as stored, --quantization unset); pass "
                                  f"--quantization int4 to round it to int4, or --quantization none to serve every "
                                  f"expert in --dtype")
        return reader

    def plan(self, values, scales) -> None:
        """Nothing to decide per weight."""
        return None

    def linear(self, x, values, scales, bias=None, plan=None):
        if self.layout.column_groups:
            raise ValueError("--quantization int4 with act order (column groups) keeps routed experts only: a "
                             "linear layer has no place for its columns' groups")
        return self.kernels.int4_linear(x, values, scales, self.layout, bias)

    def expert_mlp(self, masked, x, counts, w13, w13_scale, w2, w2_scale, *, w13_groups=None, w2_groups=None):
        kernel = self.kernels.int4_masked_expert_mlp if masked else self.kernels.int4_expert_mlp
        return kernel(x, counts, w13, w13_scale, w2, w2_scale, layout=self.layout, w13_groups=w13_groups,
                      w2_groups=w2_groups)
