"""The fused GEMV a captured decode step uses for few rows (moe_runtime/kernels/skinny_matmul.py, `captured_gemv_wins`).

Traced with dynamo's eager backend (the branch only exists under torch.compile). fp32 sums in another
order than the GEMM: rtol = atol = 1e-5 on outputs O(1-10). bf16 accumulates in fp32 and rounds once,
the GEMM rounds its own way: compared with the fp32 product of the same bf16 values at bf16's resolution.
"""
import torch
import torch.nn.functional as F

from moe_runtime.kernels.skinny_matmul import CAPTURED_GEMV_MAX_ROWS, captured_gemv_wins, linear_rows


def traced(x, weight, bias=None):
    seen = {}

    def step(x, weight, bias):
        seen["fused"] = captured_gemv_wins(x, weight)
        return linear_rows(x, weight, bias)

    out = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)(x, weight, bias)
    return out, seen["fused"]


def test_one_fp32_row_is_the_fused_gemv_and_equals_the_gemm():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(CAPTURED_GEMV_MAX_ROWS, 64, generator=generator)
    weight = torch.randn(512, 64, generator=generator)
    bias = torch.randn(512, generator=generator)
    for b in (None, bias):
        out, fused = traced(x, weight, b)
        assert fused and out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_bf16_row_is_widened_in_the_fused_gemv():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 64, generator=generator).bfloat16()
    x = torch.randn(CAPTURED_GEMV_MAX_ROWS, 64, generator=generator).bfloat16()
    out, fused = traced(x, weight)
    assert fused and out.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float())                                # the same bf16 values, fp32 sums
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-2)       # one rounding to bf16


def test_more_rows_other_dtypes_and_eager_calls_keep_the_gemm():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 32, generator=generator)
    cases = [(torch.randn(CAPTURED_GEMV_MAX_ROWS + 1, 32, generator=generator), weight),
             (torch.randn(CAPTURED_GEMV_MAX_ROWS + 1, 32, generator=generator).bfloat16(), weight.bfloat16()),
             (torch.randn(1, 32, generator=generator).half(), weight.half())]               # not measured
    for x, w in cases:
        out, fused = traced(x, w)
        assert not fused
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    assert not captured_gemv_wins(torch.randn(1, 32), weight)                 # not compiling
