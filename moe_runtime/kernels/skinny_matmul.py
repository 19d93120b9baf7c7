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
# Inside a captured decode step (torch.compile) one row times a weight runs as a multiply-reduce that inductor turns
# into one streaming GEMV loop (bf16 widened to fp32 in registers) instead of an extern GEMM. Measured on the 2-core
# AVX2 dev machine: chains of 16 fp32 projections inside one graph ([512 | 1024 | 2048, 512] weights, the bench
# model's sizes) take 0.95 / 2.9 / 4.6 ms that way against 1.75 / 3.2 / 6.7 ms through `linear_rows`' GEMM, and the
# bench model's captured batch-1 step went from 77 to 91 tok/s (fp32) and 114-115 to 117-133 (bf16). From two fp32
# rows on the GEMM wins; bf16 at 16 rows won in the chains but lost 7% end to end (180 vs 193 tok/s): one row only.
# Per single call, outside a graph, the compiled call's own overhead hides all of this.
CAPTURED_GEMV_MAX_ROWS = 1
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
    """Whether a captured step should compute `x @ weight.T` as a fused multiply-reduce (see CAPTURED_GEMV_MAX_ROWS)."""
    return (torch.compiler.is_compiling() and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] <= CAPTURED_GEMV_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a 2-D x [n, K] and weight [N, K] -> [n, N], fast for small n on CPU."""
    rows = x.shape[0]
    if captured_gemv_wins(x, weight):
        out = (weight[None].float() * x[:, None, :].float()).sum(-1).to(x.dtype)   # [n, N], fp32 accumulation
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
