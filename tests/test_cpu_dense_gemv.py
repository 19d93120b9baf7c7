"""The cpu family's unquantized few-row projections (moe_runtime/kernels/cpu_native/dense_gemv.py) against float64 and
torch's `linear_rows`: eager (the pybind call) and traced (the `moe_cpu::rows_linear` operator, by dynamo with
fullgraph=True, so a graph break would fail), float32 and bfloat16, rows on both paths of the kernel (four
rows per weight load, a row alone), and the row counts and shapes that keep torch's.
"""
import pytest
import torch

from moe_runtime.kernels.cpu_native import custom_ops, dense_gemv
from moe_runtime.kernels.cpu_native.dense_gemv import COMPILED_GEMV_MAX_ROWS, compiled_gemv_wins, cpu_linear_rows
from moe_runtime.kernels.skinny_matmul import linear_rows

N, K = 40, 72   # not multiples of 32 / 8: the kernel's tails run


@pytest.fixture
def small_weights_take_the_kernel(monkeypatch):
    """The rule keeps torch below 256 x 512 weights (not measured); the tests' small weights take the kernel."""
    assert custom_ops.operators() is not None, "the CPU kernel did not build (see moe_runtime/kernels/cpu_native/build.py's log)"
    monkeypatch.setattr(dense_gemv, "COMPILED_GEMV_MIN_WEIGHT", 0)


def _case(rows: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=generator).to(dtype)
    return x, torch.randn(N, K, generator=generator).to(dtype), torch.randn(N, generator=generator).to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_compiled_gemv_matches_float64(small_weights_take_the_kernel, rows, dtype, tolerance, traced):
    x, weight, bias = _case(rows, dtype, seed=rows)
    assert compiled_gemv_wins(x, weight)
    run = torch.compile(cpu_linear_rows, backend="eager", fullgraph=True) if traced else cpu_linear_rows
    got = run(x, weight, bias)                                                      # [rows, N]
    want = x.double() @ weight.double().T + bias.double()                           # the same bf16 values, exact
    assert got.dtype == dtype and got.shape == (rows, N)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= tolerance * scale           # one rounding to dtype
    twin = linear_rows(x, weight, bias)
    assert (got.double() - want).abs().max() <= (twin.double() - want).abs().max() * 2 + 1e-6 * scale


def test_more_rows_small_weights_and_other_dtypes_keep_torch():
    x, weight, _ = _case(COMPILED_GEMV_MAX_ROWS + 1, torch.float32, seed=0)
    big = torch.randn(256, 512)
    assert not compiled_gemv_wins(x, weight)                                        # small weight
    assert compiled_gemv_wins(torch.randn(COMPILED_GEMV_MAX_ROWS, 512), big)
    assert not compiled_gemv_wins(torch.randn(COMPILED_GEMV_MAX_ROWS + 1, 512), big)
    assert not compiled_gemv_wins(torch.randn(1, 512).half(), big.half())
    assert not compiled_gemv_wins(torch.randn(1, 512), big.bfloat16())              # mixed dtypes
    assert torch.equal(cpu_linear_rows(x, weight), linear_rows(x, weight))
