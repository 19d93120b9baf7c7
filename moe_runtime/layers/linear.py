"""Linear and embedding layers whose weights come from the checkpoint (no random init).

A tensor-parallel rank holds a shard: `LinearShard(dim=0)` keeps output rows [start, stop)
(column parallel), `dim=1` keeps input columns (row parallel: partial sums, the caller all-reduces).
Only that shard is read from the checkpoint.

With `quant` (`--quantization fp8 | int8`, a `WeightQuantization`) the weight is kept in the format's
values dtype with float32 scales (`weight_scale`: FP8's row-expanded block scales [N, ceil(K/bk)], int8's
one scale per row [N]; see moe_runtime/weights/quantization/) and every forward runs the kernel family's
quantized linear, which never dequantizes the whole weight; the bias stays in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_runtime.kernels.skinny_matmul import linear_rows
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.quantization.weight_quantization import WeightQuantization
from moe_runtime.weights.loading import copy_checked


@dataclass(frozen=True)
class LinearShard:
    dim: int      # 0: output rows; 1: input columns
    start: int
    stop: int


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32, device=None,
                 shard: LinearShard | None = None, quant: WeightQuantization | None = None):
        super().__init__()
        self.shard = shard
        full_in = in_features
        if shard is not None and shard.dim == 0:
            out_features = shard.stop - shard.start
        if shard is not None and shard.dim == 1:
            in_features = shard.stop - shard.start
        if quant is not None and shard is not None and shard.dim == 1 and not quant.fits_columns(
                shard.start, shard.stop, full_in):
            quant = None   # the shard cuts a scale block: this layer keeps the compute dtype
        self.quant = quant
        self.quant_plan = None   # what the format decided of the loaded weight (`WeightQuantization.plan`)
        weight_dtype = quant.values_dtype if quant else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype, device=device),
                                   requires_grad=False)
        self.weight_scale = None if quant is None else nn.Parameter(
            torch.empty(quant.scale_shape(out_features, in_features), dtype=torch.float32, device=device),
            requires_grad=False)                                     # fp8 [N, ceil(K / block_k)]; int8 [N]
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.matmul = linear_rows   # unquantized: the kernel family's, bound when the model is built (registry.py)

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        loaded = set()
        if self.quant is not None:
            self._load_quantized(reader, f"{prefix}weight")
            loaded |= {"weight", "weight_scale"}
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if name in loaded or param is None:
                continue
            full = f"{prefix}{name}"
            if self.shard is None or (name == "bias" and self.shard.dim == 1):
                tensor = reader.read(full)  # a row-parallel bias is whole (added once, after the reduce)
            else:
                tensor = reader.read_slice(full, self.shard.dim, self.shard.start, self.shard.stop)
            copy_checked(param, tensor, full, reader.directory)
            loaded.add(name)
        return loaded

    def _load_quantized(self, reader: CheckpointReader, full: str) -> None:
        rows = (self.quant.read(reader, full) if self.shard is None else
                self.quant.read_slice(reader, full, self.shard.dim, self.shard.start, self.shard.stop))
        copy_checked(self.weight, rows.values, full, reader.directory)
        copy_checked(self.weight_scale, rows.scales, full + "_scale_inv", reader.directory)
        self.quant_plan = self.quant.plan(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        bias = None if self.shard is not None and self.shard.dim == 1 else self.bias  # row parallel: see `reduce`
        if self.quant is not None:
            return self.quant.linear(x, self.weight, self.weight_scale, bias, self.quant_plan)
        return self.matmul(x, self.weight, bias)

    def reduce(self, partial: torch.Tensor, group) -> torch.Tensor:
        """Row parallel: sum the ranks' partial outputs, then add the bias once."""
        import torch.distributed as dist

        dist.all_reduce(partial, group=group)
        return partial if self.bias is None else partial + self.bias


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(ids, self.weight)
