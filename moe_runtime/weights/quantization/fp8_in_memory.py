"""`--quantization fp8`: linear and expert weights stay float8_e4m3fn in memory, dequantized per matmul tile.

Every weight kept this way is a pair (`Fp8Rows`): the FP8 values [N, K] and ROW-EXPANDED block
scales [N, ceil(K / block_k)], where scale[n, j] multiplies values[n, j*block_k : (j+1)*block_k].
A checkpoint stores one scale per bn x bk block; expanding it along rows costs 4 / block_k bytes per
weight (3% at 128) and buys two things the block form cannot do: gate and up stacks concatenate
into w13 whatever I is, and a tensor-parallel row shard may start at any row. A column shard (the
input dim, row-parallel layers) must start on a block_k boundary; where it does not, the layer stays
in the compute dtype (`Fp8InMemory.fits_columns`).

Weights the checkpoint does not store in FP8 (a bf16/fp32 checkpoint) are quantized at load with one
scale per row and block_k columns: the same layout, so the same kernels.

`Fp8InMemory` is one `WeightQuantization` (quantization/weight_quantization.py), int8 the other.

Checked once, at load: every weight this format hands out (`quantize`, `read`, `read_slice`) is
validated (float8_e4m3fn values [..., N, K], float32 scales [..., N, ceil(K / block_k)]), and a layer keeps it
in parameters whose shapes and dtypes its constructor fixed from this format. So `linear` calls the
kernel family's FP8 linear without its per-call checks of the weight (`prechecked_fp8_linear`); the
kernels' public entry points keep checking for every other caller.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

import moe_runtime.kernels.fp8_block_weights as torch_fp8
from moe_runtime.errors import CheckpointError
from moe_runtime.kernels import KernelSet
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, TensorSource

ONLINE_BLOCK_K = 128    # column block of weights quantized at load (DeepSeek-V3's, and the Triton tile's multiple)


@dataclass(frozen=True)
class Fp8Rows(QuantizedRows):
    """values [N, K] float8_e4m3fn, scales [N, ceil(K / block_k)] float32."""

    def columns(self, start: int, stop: int, block_k: int) -> "Fp8Rows":
        """Input columns [start, stop); `start` on a block boundary (see `Fp8InMemory.fits_columns`)."""
        return Fp8Rows(self.values[:, start:stop], self.scales[:, start // block_k: -(-stop // block_k)])


@dataclass(frozen=True)
class Fp8InMemory:
    """A `WeightQuantization`: the column block, and the kernel family whose FP8 twins multiply the weights."""

    block_k: int
    kernels: KernelSet    # fp8_linear, fp8_expert_mlp, fp8_masked_expert_mlp
    name: ClassVar[str] = "fp8"
    values_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn
    scales_dtype: ClassVar[torch.dtype] = torch.float32
    experts_only: ClassVar[bool] = False
    expert_epilogue: ClassVar[bool] = False     # its expert kernels are bias-free SiLU
    column_groups: ClassVar[bool] = False      # no per-column groups (int4 act order's)

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, columns)
    linear_kernel: Callable = field(init=False, repr=False, compare=False)   # the family's, without per-call checks

    def __post_init__(self):
        object.__setattr__(self, "linear_kernel", prechecked_fp8_linear(self.kernels))

    @classmethod
    def for_checkpoint(cls, checkpoint_format: Fp8BlockFormat | None, kernels: KernelSet) -> "Fp8InMemory":
        """The checkpoint's column block when it is FP8 (scales must not be re-cut), else ONLINE_BLOCK_K."""
        return cls(checkpoint_format.block_cols if checkpoint_format else ONLINE_BLOCK_K, kernels)

    def scale_columns(self, columns: int) -> int:
        return -(-columns // self.block_k)

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, self.scale_columns(columns))

    def fits_columns(self, start: int, stop: int, total: int) -> bool:
        """Whether input columns [start, stop) of a `total`-column weight cut along block boundaries."""
        return start % self.block_k == 0 and (stop % self.block_k == 0 or stop == total)

    def checked(self, rows: Fp8Rows, name: str) -> Fp8Rows:
        """A weight's fixed properties, checked here once so that no forward checks them again."""
        torch_fp8.check_fp8_weight(rows.values, rows.scales, self.block_k, name)
        return rows

    def quantize(self, weight: torch.Tensor) -> Fp8Rows:
        return self.checked(quantize_rows(weight, self.block_k), "weight")

    def read(self, reader: TensorSource, name: str) -> Fp8Rows:
        return self.checked(reader.read_fp8_rows(name, self.block_k), name)

    def read_slice(self, reader: TensorSource, name: str, dim: int, start: int, stop: int) -> Fp8Rows:
        whole = reader.read_fp8_rows(name, self.block_k)   # scales cover blocks, not rows: read it all, then cut
        cut = whole.rows(start, stop) if dim == 0 else whole.columns(start, stop, self.block_k)
        return self.checked(cut, name)

    def plan(self, values: torch.Tensor, scales: torch.Tensor) -> bool | None:
        """What a layer's forward needs to know of its loaded weight, asked once after loading: with the torch
        family, whether the CPU bit decode suits it (None for the other families, which decide nothing per weight)."""
        if self.linear_kernel is not torch_fp8.fp8_linear_prechecked:
            return None
        return torch_fp8.bit_decode_suits(values, scales)

    def linear(self, x, values, scales, bias=None, plan=None):
        """A layer's forward: values / scales are its parameters, loaded through this format (checked), `plan`
        what `plan` said of them."""
        if plan is None:
            return self.linear_kernel(x, values, scales, self.block_k, bias)
        return self.linear_kernel(x, values, scales, self.block_k, bias, bit_decode_suits=plan)

    def expert_mlp(self, masked, x, counts, w13, w13_scale, w2, w2_scale):
        kernel = self.kernels.fp8_masked_expert_mlp if masked else self.kernels.fp8_expert_mlp
        return kernel(x, counts, w13, w13_scale, w2, w2_scale, self.block_k)


def prechecked_fp8_linear(kernels: KernelSet) -> Callable:
    """The family's FP8 linear minus its checks of the weight: the torch family's `fp8_linear_prechecked`,
    the Triton family's `Fp8Kernels.linear_prechecked`; any other family (the reference) as it is."""
    if kernels.fp8_linear is torch_fp8.fp8_linear:
        return torch_fp8.fp8_linear_prechecked
    return getattr(getattr(kernels.fp8_linear, "__self__", None), "linear_prechecked", kernels.fp8_linear)


def expand_block_scales(scale_inv: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Checkpoint block scales [ceil(N/bn), Kb] -> row-expanded [N, Kb] (float32)."""
    return scale_inv.float().repeat_interleave(block_rows, 0)[:rows].contiguous()


def row_expanded_scales(scale: torch.Tensor, rows: int, columns: int, block_k: int, name: str,
                        block: tuple[int, int] | None = None) -> torch.Tensor:
    """A stored FP8 scale grid -> row-expanded [rows, ceil(columns / block_k)] float32, nothing rounded.

    The grid is one scale (per tensor: [] or [1]), one per row ([rows, 1]: per channel, fbgemm's row-wise), or, with
    `block` = (bn, bk), one per bn x bk block ([ceil(rows / bn), ceil(columns / bk)]; groups are blocks with bn = 1).
    Each of this format's block_k-column blocks must lie inside one stored column block: bk a multiple of block_k.
    """
    grid = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float()
    if block is None:   # one scale, or one per row
        if grid.dim() != 2 or grid.shape[1] != 1 or grid.shape[0] not in (1, rows):
            raise CheckpointError(f"{name}: FP8 scales of shape {tuple(scale.shape)} are neither one scale nor one "
                                  f"per row of a [{rows}, {columns}] weight, and no block size was given")
        block = (rows // grid.shape[0], columns)
    block_rows, block_columns = block
    if tuple(grid.shape) != (-(-rows // block_rows), -(-columns // block_columns)):
        raise CheckpointError(f"{name}: FP8 scales of shape {tuple(scale.shape)} are not one per {block_rows}x"
                              f"{block_columns} block of a [{rows}, {columns}] weight")
    if block_columns < columns and block_columns % block_k:
        raise CheckpointError(f"{name}: FP8 scales of {block_columns}-column blocks cannot be kept as blocks of "
                              f"{block_k} columns")
    per_row = grid.repeat_interleave(block_rows, 0)[:rows]                             # [rows, grid columns]
    stored_block = torch.arange(-(-columns // block_k)) * block_k // block_columns   # of each block_k block
    return per_row[:, stored_block].contiguous()                                      # [rows, ceil(K / block_k)]


def quantize_rows(weight: torch.Tensor, block_k: int) -> Fp8Rows:
    """A weight not stored in FP8, quantized with one scale per row and block_k columns."""
    values, scales = Fp8BlockFormat(1, block_k).quantize(weight)
    return Fp8Rows(values, scales)

