"""`--quantization mxfp4`: routed experts kept in MXFP4 in memory, decoded per matmul tile.

Layout (moe_runtime/kernels/mxfp4_weights.py): values uint8 [N, ceil(K/32)*16] (two e2m1 codes a byte) and e8m0
exponents uint8 [N, ceil(K/32)], one per 32-column block. Both are bytes, so an expert slot is a byte
row and migration moves it like any other (`ExpertWeights.read_slot`): 4.25 bits a weight instead of
16 (bf16).

What it keeps: an MXFP4 checkpoint's expert stacks exactly as stored (gpt-oss, `read` through the
reader's `read_mxfp4_rows`; DeepSeek-V4's FP4 experts through `read_fp4`, the same bytes); weights of any
other checkpoint are quantized at load (OCP's rule: the block's largest magnitude within e2m1's 6, nearest
code), which is lossy. The published formats quantize experts only, and so does this one (`experts_only`):
model files give it to their expert stacks and keep attention, routers, dense MLPs and the LM head in the compute dtype
(`weight_quantization.linear_quantization`). `linear` exists all the same (a layer handed this format
still computes right), through the family's `mxfp4_linear`.

The experts' biases and activation (gpt-oss's clamped SwiGLU) pass through the family's MXFP4 expert
kernels (`expert_epilogue`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_runtime.kernels import KernelSet
from moe_runtime.kernels.mxfp4_weights import MXFP4_BLOCK, block_count, check_mxfp4_weight, packed_columns, quantize_mxfp4
from moe_runtime.weights.quantization.weight_quantization import QuantizedRows, TensorSource


@dataclass(frozen=True)
class Mxfp4InMemory:
    """A `WeightQuantization`: packed e2m1 values and e8m0 scales, both uint8."""

    kernels: KernelSet    # mxfp4_linear, mxfp4_expert_mlp, mxfp4_masked_expert_mlp
    name: ClassVar[str] = "mxfp4"
    values_dtype: ClassVar[torch.dtype] = torch.uint8
    scales_dtype: ClassVar[torch.dtype] = torch.uint8
    experts_only: ClassVar[bool] = True
    expert_epilogue: ClassVar[bool] = True
    column_groups: ClassVar[bool] = False      # no per-column groups (int4 act order's)

    def values_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, packed_columns(columns))

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, block_count(columns))

    def fits_columns(self, start: int, stop: int, total: int) -> bool:
        """A column shard keeps whole 32-column blocks."""
        return start % MXFP4_BLOCK == 0 and (stop % MXFP4_BLOCK == 0 or stop == total)

    def quantize(self, weight: torch.Tensor) -> QuantizedRows:
        values, scales = quantize_mxfp4(weight)
        return QuantizedRows(values, scales)

    def read(self, reader: TensorSource, name: str) -> QuantizedRows:
        """A whole weight [N, K]: DeepSeek-V4's FP4 experts kept as stored (MXFP4's layout byte for byte), any other
        quantized at load."""
        if reader.is_fp4(name):
            return reader.read_fp4(name).as_mxfp4()
        return self.quantize(reader.read(name))

    def read_slice(self, reader: TensorSource, name: str, dim: int, start: int, stop: int) -> QuantizedRows:
        if dim == 0:
            return self.quantize(reader.read_slice(name, 0, start, stop))
        whole = self.read(reader, name)
        return QuantizedRows(whole.values[:, start // 2: packed_columns(stop)],
                             whole.scales[:, start // MXFP4_BLOCK: block_count(stop)])

    def plan(self, values, scales) -> None:
        """Nothing to decide per weight."""
        return None

    def linear(self, x, values, scales, bias=None, plan=None):
        return self.kernels.mxfp4_linear(x, values, scales, bias)

    def expert_mlp(self, masked, x, counts, w13, w13_scale, w2, w2_scale, **epilogue):
        kernel = self.kernels.mxfp4_masked_expert_mlp if masked else self.kernels.mxfp4_expert_mlp
        return kernel(x, counts, w13, w13_scale, w2, w2_scale, **epilogue)

    def check(self, rows: QuantizedRows, columns: int, name: str) -> QuantizedRows:
        check_mxfp4_weight(rows.values, rows.scales, columns, name)
        return rows
