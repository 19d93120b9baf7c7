"""`x @ w.T` for few rows on CPU, in the operand order the CPU BLAS streams weights fastest.

Decode multiplies a handful of rows by a large weight. On CPU, MKL's `x @ w.T` with 2-8 rows
runs single-threaded and packs the weight first: 5-9 GB/s of weight on the 2-core dev machine,
against 32 GB/s for a plain read. Asking for `(w @ x.T).T` instead (the weight as the left
operand, x as a transposed view) streams it at 12-37 GB/s where the activation block is small;
one row goes to gemv, which the weight-left order beats (with the row duplicated) only for short
rows. The rule below is the region where weight-left won in every cell of a grid over rows
1-8, K 256-4096, N 512-8192, 1 and 2 threads, single and batched; bf16 keeps `x @ w.T`.
`bench/bench_offline.py` and `bench/bench_moe_layer.py` show the effect end to end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_ROWS_MAX = 8            # more rows than this: the ordinary GEMM path is as good or better
# Inside a captured decode step (torch.compile), one fp32 row times a weight with at least this many output rows runs
# as a multiply-reduce that inductor turns into a streaming GEMV loop: the bench model's LM head [8192, 512] takes
# 0.9 ms that way against 1.7 ms in the extern GEMM (about 1 ms of a 10 ms step); at 512-1024 outputs the GEMM wins.
CAPTURED_GEMV_MIN_OUT = 4096
SKINNY_BLOCK_ELEMENTS = 2048   # rows * K up to this: weight-left wins (measured)
GEMV_ROW_K_MAX = 1024          # one row: weight-left (row duplicated) beats gemv up to this K


def weight_left_wins(x: torch.Tensor, rows: int, batched: bool) -> bool:
    """Whether `(w @ x.T).T` beats `x @ w.T` for `rows` rows of x on this device and dtype."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < rows <= SKINNY_ROWS_MAX:
        return False
    in_features = x.shape[-1]
    if rows == 1:
        return batched or in_features <= GEMV_ROW_K_MAX
    return rows == 2 or rows * in_features <= SKINNY_BLOCK_ELEMENTS


def captured_gemv_wins(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a captured step should compute `x @ weight.T` as a fused multiply-reduce (see CAPTURED_GEMV_MIN_OUT)."""
    return (torch.compiler.is_compiling() and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.shape[0] >= CAPTURED_GEMV_MIN_OUT)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a 2-D x [n, K] and weight [N, K] -> [n, N], fast for small n on CPU."""
    rows = x.shape[0]
    if captured_gemv_wins(x, weight):
        out = (weight[None] * x[:, None, :]).sum(-1)                      # [1, N]
        return out if bias is None else out + bias
    if x.dim() != 2 or not weight_left_wins(x, rows, batched=False):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    if rows == 1:
        x = torch.cat([x, x])                                              # [2, K]: gemm, not gemv
    out = torch.mm(weight, x.t()).t()[:rows].contiguous()                  # [n, N]
    return out if bias is None else out.add_(bias)


def batched_linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-batch x[b] @ weight[b].T: x [B, M, K], weight [B, N, K] -> [B, M, N] (M small on decode)."""
    if weight_left_wins(x, x.shape[1], batched=True):
        return torch.bmm(weight, x.contiguous().transpose(1, 2)).transpose(1, 2)   # [B, M, N] view
    return torch.bmm(x, weight.transpose(1, 2))
