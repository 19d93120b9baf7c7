"""The LM-head-sized GEMV a captured decode step uses (kernels/skinny_matmul.py, `captured_gemv_wins`).

Traced with dynamo's eager backend (the branch only exists under torch.compile); fp32 sums in another
order than the GEMM: rtol = atol = 1e-5 on outputs O(1-10).
"""
import torch
import torch.nn.functional as F

from kernels.skinny_matmul import CAPTURED_GEMV_MIN_OUT, captured_gemv_wins, linear_rows


def traced(x, weight, bias=None):
    seen = {}

    def step(x, weight, bias):
        seen["fused"] = captured_gemv_wins(x, weight)
        return linear_rows(x, weight, bias)

    out = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)(x, weight, bias)
    return out, seen["fused"]


def test_one_row_times_a_wide_weight_is_the_fused_gemv_and_equals_the_gemm():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=generator)
    weight = torch.randn(CAPTURED_GEMV_MIN_OUT, 64, generator=generator)
    bias = torch.randn(CAPTURED_GEMV_MIN_OUT, generator=generator)
    for b in (None, bias):
        out, fused = traced(x, weight, b)
        assert fused
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_narrow_weights_more_rows_bf16_and_eager_calls_keep_the_gemm():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(CAPTURED_GEMV_MIN_OUT, 32, generator=generator)
    cases = [(torch.randn(1, 32, generator=generator), wide[:1024]),          # narrow: the GEMM wins
             (torch.randn(2, 32, generator=generator), wide),                 # two rows
             (torch.randn(1, 32, generator=generator).bfloat16(), wide.bfloat16())]
    for x, weight in cases:
        out, fused = traced(x, weight)
        assert not fused
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2)
    assert not captured_gemv_wins(torch.randn(1, 32), wide)                   # not compiling
