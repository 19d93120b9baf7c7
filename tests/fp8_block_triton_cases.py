"""The Triton FP8 block-scaled weight kernels against the naive reference (collected by
test_fp8_block_kernels.py).

With CUDA they run compiled in bf16 and fp32; on CPU in the Triton interpreter in fp32 and fp16
(the interpreter has no bf16), in a child process started with TRITON_INTERPRET=1. These cases run
the dequantize scheme (fp8_scheme.py), whatever the device's own choice: FP8 weights read the way the
device can (the bytes decoded by hand in the interpreter and below sm89, the native float8_e4m3fn load
on sm89+); one test forces each of the two reads in turn. The FP8-activation scheme, the default on
sm89+, has its own cases (fp8_activation_triton_cases.py).

Tolerances (outputs are O(1)): fp32 rtol = atol = 1e-4. In fp16 / bf16 the dequantized weight tile
and the SwiGLU activation between the two projections are rounded to that dtype before tl.dot:
fp16 rtol = atol = 5e-3, bf16 rtol = atol = 3e-2 (those of triton_kernel_cases.py).
"""
import os

import pytest
import torch
import triton
import triton.language as tl
from fp8_block_inputs import all_e4m3_codes, random_fp8_experts, random_fp8_weight, strided

from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.triton_impl.fp8_e4m3 import e4m3_bits_to_float
from moe_runtime.kernels.triton_impl.fp8_scheme import Fp8Scheme, device_fp8_scheme
from moe_runtime.kernels.triton_impl.kernel_set import triton_kernel_set

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]
ORACLE = get_kernels("cpu", "reference")
HIDDEN, INTERMEDIATE = 56, 52        # partial last column blocks for block_k 16 and 48
NATIVE_HERE = ON_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("fp8_block_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton is "
                       "imported")


@pytest.fixture(scope="module")
def triton_kernels():
    """The Triton family with the dequantize scheme, FP8 weights read as this device reads them by itself."""
    return triton_kernel_set(Fp8Scheme(native_loads=NATIVE_HERE))


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def to_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@triton.jit
def decode_kernel(codes_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, e4m3_bits_to_float(tl.load(codes_ptr + offs)))


def test_bytes_decode_is_exact_for_every_e4m3_code():
    codes = all_e4m3_codes().flatten()
    out = torch.empty(256, device=DEVICE)
    decode_kernel[(1,)](codes.view(torch.uint8).to(DEVICE), out, BLOCK=256)
    expected = codes.float()
    got = out.cpu()
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.signbit(), expected.signbit())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))


# block_k 24: no power of two >= 16 divides it, so each weight element looks its scale up itself.
@pytest.mark.parametrize("block_k,tokens", [(16, 0), (16, 7), (24, 7), (48, 1)])
def test_fp8_linear(triton_kernels, block_k, tokens):
    generator = torch.Generator().manual_seed(block_k + tokens)
    weight = random_fp8_weight(40, 100, block_k, generator)
    x = torch.randn(tokens, 100, generator=generator)
    bias = torch.randn(40, generator=generator)
    values, scale = to_device(weight.values, weight.scale)
    for dtype in DTYPES:
        x_d, bias_d = x.to(DEVICE, dtype), bias.to(DEVICE, dtype)
        for args, oracle_args in (((x_d, values, scale, block_k), (x_d.cpu(), weight.values, weight.scale, block_k)),
                                  ((strided(x_d), values, scale, block_k, bias_d),
                                   (x_d.cpu(), weight.values, weight.scale, block_k, bias_d.cpu()))):
            got = triton_kernels.fp8_linear(*args)
            assert got.shape == (tokens, 40) and got.dtype == dtype
            torch.testing.assert_close(got.float().cpu(), ORACLE.fp8_linear(*oracle_args).float(), **tolerance(dtype))


# [17, 0, 0, 2]: two BLOCK_M tiles for expert 0; [0, 0, 0, 0]: no rows at all.
@pytest.mark.parametrize("block_k,counts", [(16, [3, 0, 5, 1]), (48, [0, 0, 0, 0]), (48, [17, 0, 0, 2])])
def test_fp8_expert_mlp(triton_kernels, block_k, counts):
    generator = torch.Generator().manual_seed(block_k + sum(counts))
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    w13, w13_scale, w2, w2_scale = to_device(*experts.args()[:4])
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), HIDDEN, generator=generator)
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        got = triton_kernels.fp8_expert_mlp(strided(x_d), counts.to(DEVICE), w13, w13_scale, w2, w2_scale, block_k)
        assert got.shape == x.shape and got.dtype == dtype
        expected = ORACLE.fp8_expert_mlp(x_d.cpu().float(), counts, *experts.args())
        torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))


# Counts: an idle expert, a full one (count == M), one past M (treated as M: no host read may check
# it), and stale rows past each count filled with NaN / inf, which must not leak into valid rows.
def test_fp8_masked_expert_mlp_ignores_nan_stale_rows(triton_kernels):
    block_k = 48
    generator = torch.Generator().manual_seed(block_k)
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    w13, w13_scale, w2, w2_scale = to_device(*experts.args()[:4])
    counts = torch.tensor([2, 0, 1, 5])
    x = torch.randn(4, 5, HIDDEN, generator=generator)
    x[0, 2:] = float("nan")                                                  # a dispatch buffer's stale rows
    x[1] = float("nan")
    x[2, 1:] = float("inf")
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        for device_counts in (counts, torch.tensor([2, 0, 1, 9])):
            got = triton_kernels.fp8_masked_expert_mlp(x_d, device_counts.to(DEVICE), w13, w13_scale, w2, w2_scale,
                                                       block_k)
            assert got.shape == x.shape and got.dtype == dtype
            expected = ORACLE.fp8_masked_expert_mlp(torch.nan_to_num(x_d.cpu().float()), counts, *experts.args())
            for expert, count in enumerate(counts.tolist()):                  # rows past a count: undefined
                torch.testing.assert_close(got[expert, :count].float().cpu(), expected[expert, :count],
                                           **tolerance(dtype))


# Every read this device can compile: the interpreter runs both; a GPU below sm89 has no native fp8
# load in Triton, so there only the bytes read exists.
READS_HERE = ["bytes", "native"] if NATIVE_HERE or not ON_CUDA else ["bytes"]


def test_the_device_picks_its_fp8_scheme():
    """FP8 activations with native loads and dots on sm89+ (not ROCm), else the dequantize path reading bytes."""
    expected = (Fp8Scheme(native_loads=True, fp8_activations=True, native_dot=True) if NATIVE_HERE
                else Fp8Scheme(native_loads=False))
    assert device_fp8_scheme() == expected
    assert get_kernels(DEVICE, "triton").fp8_linear.__self__.scheme == expected
    weight = random_fp8_weight(4, 16, 16, torch.Generator().manual_seed(0)).values.to(DEVICE)
    assert expected.weight_operand(weight).dtype == (torch.float8_e4m3fn if NATIVE_HERE else torch.uint8)


@pytest.mark.parametrize("load", READS_HERE)
def test_native_and_bytes_reads_of_fp8_weights(load):
    """The same linear and expert MLP with the weights read each way (the device's own choice aside)."""
    kernels = triton_kernel_set(Fp8Scheme(native_loads=load == "native"))
    generator = torch.Generator().manual_seed(7)
    weight = random_fp8_weight(40, 100, 48, generator)
    experts = random_fp8_experts(2, HIDDEN, INTERMEDIATE, 16, generator)
    counts = torch.tensor([2, 3])
    x = torch.randn(5, 100, generator=generator)
    x_sorted = torch.randn(5, HIDDEN, generator=generator)
    got = kernels.fp8_linear(*to_device(x, weight.values, weight.scale), 48)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_linear(x, weight.values, weight.scale, 48),
                               **tolerance(torch.float32))
    got = kernels.fp8_expert_mlp(*to_device(x_sorted, counts, *experts.args()[:4]), 16)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_expert_mlp(x_sorted, counts, *experts.args()),
                               **tolerance(torch.float32))


def test_fp8_in_memory_takes_the_triton_linear_without_its_checks(triton_kernels):
    from moe_runtime.weights.quantization.fp8_in_memory import Fp8InMemory

    quant = Fp8InMemory(48, triton_kernels)
    assert quant.linear_kernel == triton_kernels.fp8_linear.__self__.linear_prechecked
    generator = torch.Generator().manual_seed(9)
    weight = random_fp8_weight(40, 100, 48, generator)
    x = torch.randn(3, 100, generator=generator)
    got = quant.linear(*to_device(x, weight.values, weight.scale))
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_linear(x, weight.values, weight.scale, 48),
                               **tolerance(torch.float32))
