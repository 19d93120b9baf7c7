"""Parameters made of several row ranges of one checkpoint tensor: what an attention-TP rank of a Gated DeltaNet
layer holds of a projection that stacks q, k and v of every head (its heads' rows of each part) or of a
per-head vector. Each range is read with `read_slice`, so a rank reads only its rows."""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.kernels.skinny_matmul import linear_rows
from moe_runtime.weights.loading import copy_checked

Ranges = tuple[tuple[int, int], ...]   # (start, stop) row ranges, in order


def rows_of(ranges: Ranges) -> int:
    return sum(stop - start for start, stop in ranges)


def load_rows(param: torch.Tensor, reader, name: str, ranges: Ranges) -> None:
    """Fill `param` with rows `ranges` (dim 0) of checkpoint tensor `name`."""
    parts = [reader.read_slice(name, 0, start, stop) for start, stop in ranges]
    copy_checked(param, torch.cat(parts) if len(parts) > 1 else parts[0], name, reader.directory)


class RowRangesLinear(nn.Module):
    """A bias-free linear whose output rows are `ranges` of the checkpoint's weight (column parallel)."""

    def __init__(self, in_features: int, ranges: Ranges, dtype=torch.float32, device=None):
        super().__init__()
        self.ranges = ranges
        self.weight = nn.Parameter(torch.empty(rows_of(ranges), in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def load_weights(self, reader, prefix: str) -> set[str]:
        load_rows(self.weight, reader, f"{prefix}weight", self.ranges)
        return {"weight"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, rows]
        return linear_rows(x, self.weight)
