"""The one int4 layout every int4 source is read into (compressed-tensors pack-quantized, AWQ, GPTQ) and every
int4 kernel multiplies: weight-only 4-bit codes with a float32 scale per group of input columns.

A weight [..., N, K] is kept as
- `values` uint8 [..., N, ceil(K / 2)]: byte j of a row holds column 2j in its low nibble and column 2j + 1 in its
  high nibble (an odd K leaves a last high nibble that no reader or kernel looks at; `pack_int4` writes it
  zero); codes are unsigned 0..15.
- `scales` float32: [..., N, G] for a symmetric format (the code's zero point is 8: compressed-tensors' signed int4
  stored with +8, as its packer does), or [..., N, G, 2] with zero points (`[..., 0]` the scale, `[..., 1]` the zero
  point, an integer held as float32: 0..15 for AWQ, GPTQ v2 and compressed-tensors asymmetric, 1..16 for GPTQ v1,
  which stores it minus one).
- G groups of `group_size` consecutive columns (G = ceil(K / group_size)); `group_size` None is one group per row
  (compressed-tensors' channel strategy).
- optionally `column_groups` int32 [..., K]: the group of each input column, where groups are not runs of
  consecutive columns (GPTQ with `desc_act`: its `g_idx`); None means column k is in group k // group_size.

The dequantized weight is w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)], computed in float32: the
integer difference is exact and one multiply rounds, so every path that follows this rule gets the same float32
weight. Leading dims are the weight's rows, so a row cut and an expert slot's bytes need nothing format-specific.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SYMMETRIC_ZERO = 8     # the zero point of a format without stored zero points (signed int4 stored with +8)
INT4_CODES = 16


@dataclass(frozen=True)
class Int4Layout:
    """How one int4 format groups its scales (one per engine for the experts it keeps)."""

    group_size: int | None      # consecutive input columns per scale; None: one scale per row (channel)
    zero_points: bool           # scales carry a zero point beside each scale ([..., G, 2])
    column_groups: bool = False  # weights carry `column_groups` [..., K] (GPTQ act order)

    def __post_init__(self) -> None:
        size = self.group_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"Int4Layout.group_size must be a positive integer or None (one group a row), got "
                             f"{size!r}")

    def groups(self, columns: int) -> int:
        return 1 if self.group_size is None else -(-columns // self.group_size)

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, packed_int4_columns(columns))

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, self.groups(columns), 2) if self.zero_points else (rows, self.groups(columns))

    def column_groups_of(self, columns: int) -> torch.Tensor:
        """[K] int32: the contiguous grouping (what a weight without `column_groups` uses)."""
        if self.group_size is None:
            return torch.zeros(columns, dtype=torch.int32)
        return torch.arange(columns, dtype=torch.int32) // self.group_size


def packed_int4_columns(columns: int) -> int:
    return -(-columns // 2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (integers 0..15, any integer dtype) -> uint8 [..., ceil(K / 2)] in this layout."""
    columns = codes.shape[-1]
    if columns % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_int4(values: torch.Tensor, columns: int) -> torch.Tensor:
    """uint8 [..., ceil(K / 2)] -> codes uint8 [..., K]."""
    codes = torch.stack((values & 0x0F, values >> 4), dim=-1).flatten(-2)
    return codes[..., :columns]


def check_int4_weight(layout: Int4Layout, values: torch.Tensor, scales: torch.Tensor, columns: int,
                      column_groups: torch.Tensor | None = None, name: str = "weight") -> None:
    """Validate one int4 weight of `columns` input columns (values, scales and column groups as above)."""
    if values.dtype != torch.uint8 or values.dim() < 2 or values.shape[-1] != packed_int4_columns(columns):
        raise ValueError(f"{name} must be uint8 [..., N, {packed_int4_columns(columns)}] (int4 codes of {columns} "
                         f"columns, two a byte), got {values.dtype} {tuple(values.shape)}")
    expected = (*values.shape[:-1], *layout.scale_shape(1, columns)[1:])
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(f"{name}_scale must be float32 {expected} (group size {layout.group_size}, zero points "
                         f"{layout.zero_points}), got {scales.dtype} {tuple(scales.shape)}")
    if layout.column_groups != (column_groups is not None):
        raise ValueError(f"{name}: column groups exactly with a layout that has them ({layout})")
    if column_groups is not None and (column_groups.dtype != torch.int32
                                      or tuple(column_groups.shape) != (*values.shape[:-2], columns)):
        raise ValueError(f"{name}_groups must be int32 {(*values.shape[:-2], columns)}, got {column_groups.dtype} "
                         f"{tuple(column_groups.shape)}")


def dequantize_int4(layout: Int4Layout, values: torch.Tensor, scales: torch.Tensor, columns: int,
                    column_groups: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole dequantized weight [..., N, K] by the layout's rule (loading, tests and the reference family;
    the kernels never build it whole)."""
    check_int4_weight(layout, values, scales, columns, column_groups)
    codes = unpack_int4(values, columns).float()                                  # [..., N, K]
    if column_groups is None:
        groups = layout.column_groups_of(columns).to(values.device).long()         # [K]
        index = groups.expand(*values.shape[:-1], columns)
    else:
        index = column_groups.long().unsqueeze(-2).expand(*values.shape[:-1], columns)
    if layout.zero_points:
        scale = torch.gather(scales[..., 0], -1, index)
        zero = torch.gather(scales[..., 1], -1, index)
    else:
        scale = torch.gather(scales, -1, index)
        zero = torch.full_like(scale, float(SYMMETRIC_ZERO))
    return ((codes - zero) * scale).to(dtype)


@dataclass(frozen=True)
class Int4Weight:
    """One int4 weight in this layout (what a checkpoint reader hands out and a format keeps)."""

    values: torch.Tensor                       # uint8 [..., N, ceil(K / 2)]
    scales: torch.Tensor                       # float32 [..., N, G] or [..., N, G, 2]
    columns: int                               # K
    column_groups: torch.Tensor | None = None  # int32 [..., K] (act order) or None

    def dequantized(self, layout: Int4Layout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(layout, self.values, self.scales, self.columns, self.column_groups, dtype)
