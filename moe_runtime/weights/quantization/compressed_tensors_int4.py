"""compressed-tensors' `pack-quantized` int4 weights read straight into the int4 layout, kept packed (Kimi K2 Thinking
and K2.5 ship their routed experts so: W4A16, symmetric, group 32).

A module quantized by an int4 scheme (`num_bits: 4`, `type: int`, strategy `group` or `channel`) stores
- `weight_packed` int32 [N, ceil(K/8)]: eight codes a word along K, the low nibble first, each code the signed
  value plus 8 (the library's `pack_to_int32`), so its little-endian bytes are the int4 layout's values as they are;
- `weight_scale` [N, G] (channel: [N, 1]) in the model's dtype;
- `weight_zero_point` int32 [ceil(N/8), G] when asymmetric: packed along N the same way (the signed zero plus 8);
  symmetric schemes store none (the layout's implicit zero point 8);
- `weight_shape` [2]: (N, K).
w = (stored code - stored zero) * scale, which is the library's `(x_q - zero_point) * scale` on the signed values.
Other strategies (tensor) and other widths stay with the library's compressor (`CompressedModule.dequantize`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import Int4Layout, Int4Weight, pack_int4, packed_int4_columns
from moe_runtime.weights.quantization.int32_nibbles import unpack_words

INT4_STRATEGIES = (QuantizationStrategy.GROUP.value, QuantizationStrategy.CHANNEL.value)


@dataclass(frozen=True)
class CompressedTensorsInt4Format:
    """An `Int4Format`: one int4 `pack-quantized` scheme of a compressed-tensors config."""

    layout: Int4Layout
    name: ClassVar[str] = "compressed-tensors pack-quantized"
    optional_parameters: ClassVar[tuple[str, ...]] = ()

    @property
    def parameters(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names + (("weight_zero_point",) if self.layout.zero_points else ())

    @classmethod
    def of(cls, scheme) -> "CompressedTensorsInt4Format | None":
        """The scheme's int4 format, or None where it is not an int4 one this file reads."""
        weights = scheme.weights
        if (scheme.format != CompressionFormat.pack_quantized.value or weights is None or weights.num_bits != 4
                or weights.type != QuantizationType.INT.value or weights.strategy not in INT4_STRATEGIES):
            return None
        group_size = weights.group_size if weights.strategy == QuantizationStrategy.GROUP.value else None
        return cls(Int4Layout(group_size=group_size, zero_points=not weights.symmetric))

    def shape(self, read: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
        """[N, K]: the stored `weight_shape`."""
        return weight_shape_of(read("weight_shape"), "weight_shape")

    def unpack(self, stored: dict[str, torch.Tensor], name: str) -> Int4Weight:
        packed, scale = stored["weight_packed"], stored["weight_scale"]
        rows, columns = weight_shape_of(stored["weight_shape"], name)
        groups = self.layout.groups(columns)
        if (packed.dtype != torch.int32 or scale.dim() != 2 or tuple(packed.shape) != (rows, -(-columns // 8))
                or tuple(scale.shape) != (rows, groups)):
            raise CheckpointError(f"compressed-tensors int4 weight {name!r} of shape ({rows}, {columns}): expected "
                                  f"weight_packed int32 [{rows}, {-(-columns // 8)}] and weight_scale [{rows}, "
                                  f"{groups}], got {packed.dtype} {tuple(packed.shape)} and {tuple(scale.shape)}")
        scales = scale.float()                                                          # [N, G]
        if self.layout.zero_points:
            zero_point = stored["weight_zero_point"]
            if zero_point.dtype != torch.int32 or tuple(zero_point.shape) != (-(-rows // 8), groups):
                raise CheckpointError(f"compressed-tensors int4 weight {name!r}: weight_zero_point must be int32 "
                                      f"[{-(-rows // 8)}, {groups}], got {zero_point.dtype} {tuple(zero_point.shape)}")
            zeros = unpack_words(zero_point, 0)[:rows].float()                          # [N, G]
            scales = torch.stack((scales, zeros), dim=-1)                               # [N, G, 2]
        return Int4Weight(packed_values(packed, columns), scales.contiguous(), columns)


def packed_values(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """weight_packed int32 [N, ceil(K/8)] -> the layout's values uint8 [N, ceil(K/2)]: on a little-endian host its
    bytes already are (byte j: codes 2j low, 2j + 1 high; the packer pads with zero codes)."""
    if sys.byteorder == "little":
        return packed.contiguous().view(torch.uint8)[:, :packed_int4_columns(columns)].contiguous()
    return pack_int4(unpack_words(packed, 1)[:, :columns])


def weight_shape_of(weight_shape: torch.Tensor, name: str) -> tuple[int, int]:
    """A stored `weight_shape`: two non-negative integers (N, K), else refused naming the weight."""
    if (weight_shape.dtype.is_floating_point or weight_shape.dtype.is_complex or weight_shape.numel() != 2
            or bool((weight_shape < 0).any())):
        raise CheckpointError(f"compressed-tensors int4 weight {name!r}: weight_shape must be two non-negative "
                              f"integers (N, K), got {weight_shape.dtype} {weight_shape.tolist()}")
    rows, columns = (int(d) for d in weight_shape.tolist())
    return rows, columns
