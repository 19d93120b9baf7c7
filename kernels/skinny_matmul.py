"""`x @ w.T` for few rows on CPU, in the operand order the CPU BLAS streams weights fastest.

Decode multiplies a handful of rows by a large weight. On CPU, MKL's `x @ w.T` with a few rows
runs single-threaded and packs the weight first: about 7-10 GB/s of weight on the 2-core dev
machine, against 32 GB/s for a plain read. Asking for `(w @ x.T).T` instead (the weight as the
left operand, x as a transposed view) runs at 20-37 GB/s in fp32 for up to 8 rows; one row goes
to a single-threaded gemv either way, so it is duplicated to two. bf16 has no such gap for one
matrix, but its batched form prefers `x @ w.T`. `bench/bench_moe_layer.py` shows the effect.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_ROWS_MAX = 8  # up to this many rows the weight-as-left-operand order wins in fp32 (measured)


def _weight_left_wins(x: torch.Tensor, rows: int) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and 0 < rows <= SKINNY_ROWS_MAX


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a 2-D x [n, K] and weight [N, K] -> [n, N], fast for small n on CPU."""
    rows = x.shape[0]
    if x.dim() != 2 or not _weight_left_wins(x, rows):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    if rows == 1:
        x = torch.cat([x, x])                                              # [2, K]: gemm, not gemv
    out = torch.mm(weight, x.t()).t()[:rows].contiguous()                  # [n, N]
    return out if bias is None else out.add_(bias)


def batched_linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-batch x[b] @ weight[b].T: x [B, M, K], weight [B, N, K] -> [B, M, N] (M small on decode)."""
    if _weight_left_wins(x, x.shape[1]):
        return torch.bmm(weight, x.contiguous().transpose(1, 2)).transpose(1, 2)   # [B, M, N] view
    return torch.bmm(x, weight.transpose(1, 2))
