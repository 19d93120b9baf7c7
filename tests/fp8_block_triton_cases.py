"""The Triton FP8 block-scaled weight kernels against the naive reference (collected by
test_fp8_block_kernels.py).

With CUDA they run compiled in bf16 and fp32; on CPU in the Triton interpreter in fp32 and fp16
(the interpreter has no bf16), in a child process started with TRITON_INTERPRET=1. The cases read
FP8 the way the device picks by itself (fp8_e4m3.py: the bytes decoded by hand in the interpreter, the
native float8_e4m3fn load on recent GPUs); one test forces each of the two ways in turn.

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

from kernels import get_kernels
from kernels.triton_impl import fp8_block_weights as triton_fp8
from kernels.triton_impl.fp8_e4m3 import e4m3_bits_to_float, native_fp8_loads

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]
ORACLE = get_kernels("cpu", "reference")
HIDDEN, INTERMEDIATE = 56, 52        # partial last column blocks for block_k 16 and 48
LOADS = {"native": lambda weight: weight, "bytes": lambda weight: weight.view(torch.uint8)}

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("fp8_block_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton is "
                       "imported")


@pytest.fixture(scope="module")
def triton_kernels():
    return get_kernels(DEVICE, "triton")


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


def test_fp8_masked_expert_mlp_ignores_nan_stale_rows(triton_kernels):
    block_k = 48
    generator = torch.Generator().manual_seed(block_k)
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    w13, w13_scale, w2, w2_scale = to_device(*experts.args()[:4])
    counts = torch.tensor([2, 0, 1, 5])
    x = torch.randn(4, 5, HIDDEN, generator=generator)
    x[0, 2:] = float("nan")                                                  # a dispatch buffer's stale rows
    x[2, 1:] = float("inf")
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        got = triton_kernels.fp8_masked_expert_mlp(x_d, counts.to(DEVICE), w13, w13_scale, w2, w2_scale, block_k)
        assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
        assert torch.all(got[0, 2:] == 0) and torch.all(got[1] == 0) and torch.all(got[2, 1:] == 0)
        expected = ORACLE.fp8_masked_expert_mlp(torch.nan_to_num(x_d.cpu().float()), counts, *experts.args())
        torch.testing.assert_close(got.float().cpu(), expected, **tolerance(dtype))


# Every read this device can compile: the interpreter runs both; a GPU below sm89 has no native fp8
# load in Triton, so there only the bytes read exists (and the kernels pick it: the next test).
READS_HERE = sorted(load for load in LOADS if load == "bytes" or not ON_CUDA or native_fp8_loads(torch.device(DEVICE)))


def test_the_device_picks_the_bytes_read_where_it_has_no_native_fp8_load():
    weight = random_fp8_weight(4, 16, 16, torch.Generator().manual_seed(0)).values.to(DEVICE)
    native = ON_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)
    assert triton_fp8.fp8_operand(weight).dtype == (torch.float8_e4m3fn if native else torch.uint8)


@pytest.mark.parametrize("load", READS_HERE)
def test_native_and_bytes_reads_of_fp8_weights(triton_kernels, load, monkeypatch):
    """The same linear and expert MLP with the weights read each way (the device's own choice aside)."""
    monkeypatch.setattr(triton_fp8, "fp8_operand", LOADS[load])
    generator = torch.Generator().manual_seed(7)
    weight = random_fp8_weight(40, 100, 48, generator)
    experts = random_fp8_experts(2, HIDDEN, INTERMEDIATE, 16, generator)
    counts = torch.tensor([2, 3])
    x = torch.randn(5, 100, generator=generator)
    x_sorted = torch.randn(5, HIDDEN, generator=generator)
    got = triton_kernels.fp8_linear(*to_device(x, weight.values, weight.scale), 48)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_linear(x, weight.values, weight.scale, 48),
                               **tolerance(torch.float32))
    got = triton_kernels.fp8_expert_mlp(*to_device(x_sorted, counts, *experts.args()[:4]), 16)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_expert_mlp(x_sorted, counts, *experts.args()),
                               **tolerance(torch.float32))
