"""The cpu family's unquantized projections (attention, dense MLPs, shared experts, LM head): the compiled few-row
kernel (`rows_linear` in expert_mlp.cpp: each weight row streamed once for every row of x, bfloat16 widened in
registers, float32 accumulation, threads over output rows) where it beats torch, `linear_rows` elsewhere.

Where it wins was measured by bench/bench_cpu_gemv.py (bench/results/cpu_gemv.json) on the 2-core AVX2 machine,
loaded by other jobs (load average 5-8: the figures are noisy, torch's MKL calls the worst hit): at 1-16 rows
the compiled kernel was ahead of `linear_rows` (MKL) in every cell on the bench models' shapes from 256 x 512
(k/v projections) to 8192 x 768 (LM head), float32 and bfloat16, called directly and as its operator (the
dispatcher adds a few microseconds), typically 1.3-3x where MKL did not stall outright. Smaller weights were not
measured and keep torch's; more rows keep MKL's blocking. To re-decide on an idle machine, rerun the bench.

Eager calls go straight to the pybind function (no operator dispatch); a captured step calls the operator, which
inductor keeps as one extern call. The family hands this out only where the kernel built (moe_runtime/kernels/kernel_set.py),
so the check here is on static properties alone (traceable).
"""
from __future__ import annotations

import torch

from moe_runtime.kernels.cpu_native.build import native_experts
from moe_runtime.kernels.skinny_matmul import linear_rows

COMPILED_GEMV_MAX_ROWS = 16              # more rows: MKL's GEMM blocking wins (bench/results/cpu_gemv.json)
COMPILED_GEMV_MIN_WEIGHT = 256 * 512     # the smallest weight measured (k/v projections of the bench model)
GEMV_DTYPES = (torch.float32, torch.bfloat16)


def compiled_gemv_wins(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` should run the compiled kernel (see the module's top)."""
    return (x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= COMPILED_GEMV_MAX_ROWS
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and weight.numel() >= COMPILED_GEMV_MIN_WEIGHT)


def cpu_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [n, K] and weight [N, K] -> [n, N]; the compiled kernel where `compiled_gemv_wins`."""
    if not compiled_gemv_wins(x, weight):
        return linear_rows(x, weight, bias)
    if torch.compiler.is_compiling():
        out = torch.ops.moe_cpu.rows_linear(x.contiguous(), weight.contiguous())   # [n, N]
        return out if bias is None else out + bias
    out = native_experts().rows_linear(x.contiguous(), weight.contiguous())       # [n, N]
    return out if bias is None else out.add_(bias)
