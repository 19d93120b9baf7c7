"""What a layer needs to know about weights kept quantized in memory (`--quantization fp8 | int8 | mxfp4 | int4`).

One object per engine (`BuildContext.quant`) says how linear and expert weights are kept; `Linear`,
`ExpertWeights` and `DenseMLP` take it as `quant=` and never ask which format it is. These formats
satisfy the Protocol:

- `Fp8InMemory` (quantization/fp8_in_memory.py): float8_e4m3fn values [N, K] with row-expanded block
  scales [N, ceil(K / block_k)]; an FP8 checkpoint's blocks kept as stored.
- `Int8InMemory` (quantization/int8_in_memory.py): int8 values [N, K], one scale per row [N],
  quantized at load from whatever the checkpoint holds.
- `Mxfp4InMemory` (quantization/mxfp4_in_memory.py): packed e2m1 values uint8 [N, ceil(K/32)*16] with
  e8m0 scales uint8 [N, ceil(K/32)]; experts only (`experts_only`), as gpt-oss's checkpoints store them.
- `Int4InMemory` (quantization/int4_in_memory.py): packed int4 codes uint8 [N, ceil(K/2)] with float32 group
  scales [N, G(, 2)] in one `Int4Layout` (an int4 checkpoint's own, as stored); experts only. With act order
  (`column_groups`) each weight also names its columns' groups, int32 [K], which expert stacks keep per slot.

Every weight is then a pair (`QuantizedRows`): values and float32 scales whose leading dims are the
weight's rows, so a row cut (`rows`) and an expert slot's bytes (`ExpertWeights.read_slot`) are the
same for both formats.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from moe_runtime.kernels.int4_layout import Int4Weight


@dataclass(frozen=True)
class QuantizedRows:
    values: torch.Tensor   # [N, K] in the format's values_dtype (MXFP4: [N, packed K])
    scales: torch.Tensor   # [N, ...] in the format's scales_dtype: the format's scales of each row

    def rows(self, start: int, stop: int) -> "QuantizedRows":
        return replace(self, values=self.values[start:stop], scales=self.scales[start:stop])


class TensorSource(Protocol):
    """What a quantized format reads from a checkpoint (`weights.checkpoint.CheckpointReader` is one)."""

    plain_tensors: bool   # an update's float tensors (not a release): a weight kept quantized rounds them

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor in a float dtype (FP8 blocks dequantized)."""
        ...

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """[start, stop) along `dim` (0 or 1), reading only that part where the storage allows."""
        ...

    def read_fp8_rows(self, name: str, block_k: int) -> "QuantizedRows":
        """FP8 values [N, K] with row-expanded scales [N, ceil(K/block_k)]."""
        ...

    def is_fp4(self, name: str) -> bool:
        """Whether `name` is stored as DeepSeek-V4's packed FP4 (quantization/deepseek_fp4_format.py)."""
        ...

    def read_fp4(self, name: str):
        """That FP4 weight as stored (`PackedFp4`: values uint8 [N, K/2], e8m0 scales uint8 [N, K/32])."""
        ...

    def read_int4(self, name: str) -> "Int4Weight | None":
        """`name` as stored in an int4 checkpoint, in the checkpoint's `Int4Layout` (kernels/int4_layout.py); None
        where the checkpoint does not store it as int4."""
        ...


class WeightQuantization(Protocol):
    """How this engine keeps linear and expert weights quantized, and the kernel family that multiplies them."""

    name: str                    # the --quantization value
    values_dtype: torch.dtype    # dtype of the stored values
    scales_dtype: torch.dtype    # dtype of the stored scales (float32; MXFP4's e8m0 exponents: uint8)
    experts_only: bool           # True: only expert stacks take this format (`linear_quantization`)
    expert_epilogue: bool        # whether its expert kernels take expert biases and a non-SiLU activation
    column_groups: bool          # weights carry their columns' groups int32 [K] (int4 act order): expert stacks keep
                                 # them per slot and pass them to `expert_mlp` as w13_groups / w2_groups

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        """Shape of the stored values of a [rows, columns] weight ([rows, columns] but for packed formats)."""
        ...

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        """Shape of the float32 scales of a [rows, columns] weight."""
        ...

    def fits_columns(self, start: int, stop: int, total: int) -> bool:
        """Whether input columns [start, stop) of a `total`-column weight can be kept (a row-parallel shard);
        a layer whose shard cannot stays in the compute dtype."""
        ...

    def quantize(self, weight: torch.Tensor) -> QuantizedRows:
        """A weight [N, K] read in a float dtype, quantized."""
        ...

    def read(self, reader: TensorSource, name: str) -> QuantizedRows:
        """A whole checkpoint weight, quantized (an FP8 checkpoint's FP8 tensor kept as stored where the format can)."""
        ...

    def read_slice(self, reader: TensorSource, name: str, dim: int, start: int, stop: int) -> QuantizedRows:
        """Rows (dim 0) or input columns (dim 1, `fits_columns`) [start, stop) of a checkpoint weight."""
        ...

    def plan(self, values: torch.Tensor, scales: torch.Tensor) -> object | None:
        """What the format decides once per loaded weight (fixed properties of its values), for `linear`."""
        ...

    def linear(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None, plan: object | None = None) -> torch.Tensor:
        """F.linear(x [..., K], the dequantized weight, bias) -> [..., N] in x.dtype; `plan`: `plan`'s answer."""
        ...

    def expert_mlp(self, masked: bool, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, **epilogue) -> torch.Tensor:
        """The kernel family's expert MLP for these weights: contiguous ([N, H] grouped by expert) or masked
        ([E, M, H]) layout, unweighted outputs in the same layout. `epilogue` (b13, b2, activation) only where
        `expert_epilogue`; w13_groups [E, H] / w2_groups [E, I] only where `column_groups`."""
        ...


def linear_quantization(quant: WeightQuantization | None) -> WeightQuantization | None:
    """The format a model's non-expert layers (attention projections, dense MLPs, shared experts) take:
    `quant` itself, or None (the compute dtype) for a format that keeps experts only (MXFP4)."""
    return None if quant is None or quant.experts_only else quant
