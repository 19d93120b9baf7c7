"""GPTQ checkpoints (`quant_method: gptq`, AutoGPTQ / GPTQModel, `checkpoint_format` gptq or gptq_v2).

Each quantized linear `<module>` of a [N, K] weight (N outputs, K inputs) stores:
- `qweight` int32 [K/8, N]: packed along K, nibble i of word [r, n] is the code of input row 8r + i;
- `qzeros` int32 [G, N/8]: packed along N (nibble i of word [g, j] is column 8j + i); format "gptq" (v1) stores
  each zero point minus one (the historical offset every v1 kernel adds back: a zero of 0 reads as 16, which the
  int4 layout's float32 zero holds as it is), "gptq_v2" stores the zero point itself;
- `scales` fp16 [G, N];
- `g_idx` int32 [K]: the group of each input column. Without `desc_act` it is k // group_size (older writers may
  omit it); with `desc_act` (act order) it is any grouping, which the int4 layout keeps as `column_groups`.
w[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].

`sym: true` writes every zero point 8 (7 in v1): those weights are read into the layout without zero points, and
a zero point other than 8 is refused by name. Bits other than 4, other formats (marlin, bitblas, ...) and
per-module `dynamic` overrides are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.kernels.int4_layout import SYMMETRIC_ZERO, Int4Layout, Int4Weight, pack_int4
from moe_runtime.weights.quantization.int32_nibbles import NIBBLES_PER_WORD, unpack_words
from moe_runtime.weights.quantization.int4_config_fields import int4_bits, int4_group_size

QUANT_METHOD = "gptq"
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}   # what a checkpoint format's stored zero points lack
INDEX_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class GptqFormat:
    """An `Int4Format`: GPTQ's packing."""

    layout: Int4Layout
    zero_offset: int     # added to each stored zero point
    name: ClassVar[str] = "GPTQ"
    parameters: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_parameters: ClassVar[tuple[str, ...]] = ("g_idx",)

    @classmethod
    def of(cls, quant: dict, where: str) -> "GptqFormat":
        """From config.json's `quantization_config`, refused by the field it cannot read."""
        int4_bits(quant, "GPTQ", where)
        checkpoint_format = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
        group_size = int4_group_size(quant, "GPTQ", where)
        if checkpoint_format not in ZERO_OFFSETS:
            raise CheckpointError(f"{where}: GPTQ quantization_config.checkpoint_format {checkpoint_format!r}: only "
                                  f"{tuple(ZERO_OFFSETS)} packing is read")
        if quant.get("dynamic"):
            raise CheckpointError(f"{where}: GPTQ quantization_config.dynamic (per-module overrides) is not read")
        layout = Int4Layout(group_size=group_size, zero_points=not quant.get("sym", True), column_groups=bool(quant.get("desc_act", False)))
        return cls(layout, ZERO_OFFSETS[checkpoint_format])

    def shape(self, read: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple[int, ...]]) -> tuple[int, int]:
        """[N, K] from the stored shapes (qweight [K/8, N])."""
        stored = shape_of("qweight")
        if len(stored) != 2:
            raise CheckpointError(f"GPTQ qweight must be int32 [K/8, N], got shape {tuple(stored)}")
        words, rows = stored
        return rows, words * NIBBLES_PER_WORD

    def unpack(self, stored: dict[str, torch.Tensor], name: str) -> Int4Weight:
        qweight, qzeros, scales = stored["qweight"], stored["qzeros"], stored["scales"]
        for local, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            if tensor.dim() != 2:
                raise CheckpointError(f"GPTQ weight {name!r}: {local} must be 2-D, got shape {tuple(tensor.shape)}")
        words, rows = qweight.shape
        columns = words * NIBBLES_PER_WORD
        groups = scales.shape[0]
        if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or tuple(scales.shape) != (groups, rows)
                or tuple(qzeros.shape) != (groups, -(-rows // NIBBLES_PER_WORD))
                or groups != self.layout.groups(columns)):
            raise CheckpointError(
                f"GPTQ weight {name!r}: expected qweight int32 [K/8, N], qzeros int32 [G, N/8] and scales [G, N] "
                f"(group size {self.layout.group_size}), got qweight {qweight.dtype} {tuple(qweight.shape)}, qzeros "
                f"{qzeros.dtype} {tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
        codes = unpack_words(qweight, 0)                                             # [K, N]
        zeros = unpack_words(qzeros, 1)[:, :rows].float() + self.zero_offset         # [G, N]
        column_groups = self._column_groups(stored.get("g_idx"), columns, groups, name)
        if self.layout.zero_points:
            group_scales = torch.stack((scales.float(), zeros), dim=-1).transpose(0, 1)   # [N, G, 2]
        else:
            if not bool((zeros == SYMMETRIC_ZERO).all()):
                raise CheckpointError(f"GPTQ weight {name!r}: quantization_config.sym is true but its qzeros hold zero "
                                      f"points other than {SYMMETRIC_ZERO}")
            group_scales = scales.float().t()                                         # [N, G]
        return Int4Weight(pack_int4(codes.t()), group_scales.contiguous(), columns, column_groups)

    def _column_groups(self, g_idx: torch.Tensor | None, columns: int, groups: int, name: str) -> torch.Tensor | None:
        """[K] int32 under act order; None otherwise, where `g_idx` (if stored) must be the contiguous grouping."""
        if g_idx is None:
            if self.layout.column_groups:
                raise CheckpointError(f"GPTQ weight {name!r}: quantization_config.desc_act is true but "
                                      f"{name.removesuffix('.weight')}.g_idx is missing")
            return None
        if g_idx.dtype not in INDEX_DTYPES:   # a float group would truncate into another group's scales
            raise CheckpointError(f"GPTQ weight {name!r}: g_idx must hold integers, got {g_idx.dtype}")
        if (tuple(g_idx.shape) != (columns,) or bool((g_idx < 0).any())   # checked before narrowing to int32
                or bool((g_idx >= groups).any())):
            raise CheckpointError(f"GPTQ weight {name!r}: g_idx must be [{columns}] groups in 0..{groups - 1}, got "
                                  f"{tuple(g_idx.shape)} ranging {int(g_idx.min())}..{int(g_idx.max())}")
        g_idx = g_idx.to(torch.int32)
        if self.layout.column_groups:
            return g_idx.contiguous()
        if not torch.equal(g_idx, self.layout.column_groups_of(columns)):
            raise CheckpointError(f"GPTQ weight {name!r}: quantization_config.desc_act is false but its g_idx is not "
                                  f"k // group_size ({self.layout.group_size})")
        return None
