"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's `version: gemm`, the form community AWQ releases ship in).

Each quantized linear `<module>` of a [N, K] weight (N outputs, K inputs) stores, input-major:
- `qweight` int32 [K, N/8]: eight 4-bit codes a word along N, in AWQ's interleaved order: nibble i of word j
  holds output column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i];
- `qzeros` int32 [K/group, N/8]: each group's zero point, packed the same way (stored as is, 0..15);
- `scales` fp16 [K/group, N].
w[n, k] = (code - zero[g(k), n]) * scale[g(k), n] with g(k) = k // group_size: the int4 layout's rule
(moe_runtime/kernels/int4_layout.py) once transposed to [N, K]. `modules_to_not_convert` need not be read: those
modules store a plain `weight`.

Other AWQ versions (gemv, gemv_fast, marlin, exllama, ipex) pack otherwise and are refused by name, as are
`bits` other than 4 and `zero_point: false`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import Int4Layout, Int4Weight, pack_int4
from moe_runtime.weights.quantization.int32_nibbles import unpack_words
from moe_runtime.weights.quantization.int4_config_fields import int4_bits, int4_group_size

QUANT_METHOD = "awq"
NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)   # the output column (within its word's eight) of nibble i
READ_VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AwqFormat:
    """An `Int4Format`: AWQ gemm's packing."""

    layout: Int4Layout
    name: ClassVar[str] = "AWQ"
    parameters: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_parameters: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def of(cls, quant: dict, where: str) -> "AwqFormat":
        """From config.json's `quantization_config`, refused by the field it cannot read."""
        int4_bits(quant, "AWQ", where)
        version = str(quant.get("version", quant.get("format", "gemm"))).lower()
        group_size = int4_group_size(quant, "AWQ", where)
        if version not in READ_VERSIONS:
            raise CheckpointError(f"{where}: AWQ quantization_config.version {version!r}: only {READ_VERSIONS} "
                                  f"packing is read")
        if not quant.get("zero_point", True):
            raise CheckpointError(f"{where}: AWQ quantization_config.zero_point false: only AWQ with zero points "
                                  f"(AutoAWQ's gemm) is read")
        return cls(Int4Layout(group_size=group_size, zero_points=True))

    def shape(self, read: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
        """[N, K] from the stored shapes (scales [G, N], qweight [K, N/8])."""
        scales, qweight = shape_of("scales"), shape_of("qweight")
        if len(scales) != 2 or len(qweight) != 2:
            raise CheckpointError(f"AWQ scales [G, N] and qweight [K, N/8] must be 2-D, got shapes {tuple(scales)} "
                                  f"and {tuple(qweight)}")
        return scales[1], qweight[0]

    def unpack(self, stored: dict[str, torch.Tensor], name: str) -> Int4Weight:
        qweight, qzeros, scales = stored["qweight"], stored["qzeros"], stored["scales"]
        for local, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            if tensor.dim() != 2:
                raise CheckpointError(f"AWQ weight {name!r}: {local} must be 2-D, got shape {tuple(tensor.shape)}")
        columns, words = qweight.shape
        rows = scales.shape[-1]
        groups = self.layout.groups(columns)
        if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or rows > 8 * words
                or tuple(qzeros.shape) != (groups, words) or tuple(scales.shape) != (groups, rows)):
            raise CheckpointError(
                f"AWQ weight {name!r}: expected qweight int32 [K, N/8], qzeros int32 [{groups}, N/8] and scales "
                f"[{groups}, N] (group size {self.layout.group_size}), got qweight {qweight.dtype} "
                f"{tuple(qweight.shape)}, qzeros {qzeros.dtype} {tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
        codes = unpack_words(qweight, 1, NIBBLE_COLUMNS)[:, :rows]                  # [K, N]
        zeros = unpack_words(qzeros, 1, NIBBLE_COLUMNS)[:, :rows]                   # [G, N]
        group_scales = torch.stack((scales.float(), zeros.float()), dim=-1)          # [G, N, 2]
        return Int4Weight(pack_int4(codes.t()), group_scales.transpose(0, 1).contiguous(), columns)
