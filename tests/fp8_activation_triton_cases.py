"""The FP8-activation scheme of the Triton grouped GEMM (DeepGEMM's: activations quantized 1x128,
fp8 x fp8 per K tile, scaled per k-block) against its float64 reference (fp8_activation_reference.py).
Collected by test_fp8_block_kernels.py on CUDA, run by test_kernels_triton.py's interpreter child on CPU.

What runs: on an sm89+ GPU the native scheme (float8e4nv tiles into tl.dot); on other GPUs and in the
interpreter the same scheme with the dot emulated (both fp8 tiles decoded to fp32 exactly, ieee dot),
which the kernel set never picks by itself there but which checks everything around the MMA: the
quantizer (bit for bit against moe_runtime/dispatch/fp8_activations.py), the scale indexing per activation group
and weight block, the fp32 accumulation across K tiles, and the masked layout's device-side counts.

Tolerances (outputs O(1)) against the float64 reference that quantizes the activations the same way:
fp32 emulated 1e-4 (measured ~1e-6: only fp32 summation differs); fp32 native 2e-3 (an fp8 MMA adds
with fewer than fp32's bits inside one K tile; DeepGEMM promotes every 128 K for the same reason);
fp16 5e-3 and bf16 3e-2 (the output's and the stored SwiGLU activation's rounding). Each test also
checks the result is NOT within tolerance of the weight-only result: the activations were quantized.
"""
import os

import pytest
import torch
import triton
import triton.language as tl
from fp8_activation_reference import (fp8_activation_expert_mlp, fp8_activation_linear,
                                      fp8_activation_masked_expert_mlp)
from fp8_block_inputs import random_fp8_experts, random_fp8_weight, strided
from host_reads import HostReadWatch

from moe_runtime.dispatch.fp8_activations import GROUP_SIZE, quantize_token_groups
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.triton_impl.fp8_activations import quantize_activations
from moe_runtime.kernels.triton_impl.fp8_e4m3 import float_to_e4m3_bits
from moe_runtime.kernels.triton_impl.fp8_scheme import ACTIVATION_GROUP, Fp8Scheme
from moe_runtime.kernels.triton_impl.kernel_set import triton_kernel_set

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
NATIVE = ON_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)
SCHEME = Fp8Scheme(native_loads=NATIVE, fp8_activations=True, native_dot=NATIVE)
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32, torch.float16]
ORACLE = get_kernels("cpu", "reference")
HIDDEN, INTERMEDIATE = 160, 72       # two activation groups, the second partial; partial weight blocks

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("fp8_activation_triton_cases.py runs on CUDA or with TRITON_INTERPRET=1 set before triton "
                       "is imported")


@pytest.fixture(scope="module")
def kernels():
    return triton_kernel_set(SCHEME)


def tolerance(dtype):
    fp32 = 2e-3 if NATIVE else 1e-4
    return {torch.float32: dict(rtol=fp32, atol=fp32), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def check(got, expected, weight_only, dtype):
    """got (the kernel's) matches the FP8-activation reference, and is distinguishable from weight-only FP8."""
    torch.testing.assert_close(got.double().cpu(), expected, **tolerance(dtype))
    tol = tolerance(dtype)
    outside = (got.double().cpu() - weight_only.double()).abs() > tol["atol"] + tol["rtol"] * weight_only.abs()
    assert got.numel() == 0 or outside.any(), "the activations were not quantized"


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


# ----------------------------------------------------------------------------------------- quantizer

@triton.jit
def encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, float_to_e4m3_bits(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_e4m3_encoder_rounds_as_torch():
    """Every e4m3 value, every midpoint between two (ties to even) and its neighbours, subnormals, +-0."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].unique()                                  # [253] sorted
    mids = (finite[:-1] + finite[1:]) / 2
    values = torch.cat([finite, mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1]),
                        (torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 448,
                        torch.tensor([0.0, -0.0, 2.0 ** -10, -(2.0 ** -10)])])
    out = torch.empty(values.numel(), dtype=torch.uint8, device=DEVICE)
    encode_kernel[(triton.cdiv(values.numel(), 1024),)](values.to(DEVICE), out, values.numel(), BLOCK=1024)
    assert torch.equal(out.cpu(), values.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantizer_is_dispatchs_bit_for_bit(dtype):
    assert ACTIVATION_GROUP == GROUP_SIZE
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(19, 2 * HIDDEN, generator=generator) * torch.rand(19, 1, generator=generator) * 30
    x[2, :128] = 0.0                                                         # an all-zero group: scale from the floor
    x = x.to(dtype)[:, ::2]                                                  # strided, [19, 160]
    got = quantize_activations(x.to(DEVICE), SCHEME)
    expected = quantize_token_groups(x)
    assert torch.equal(got.values.cpu().view(torch.uint8), expected.values.view(torch.uint8))
    assert torch.equal(got.scales.cpu(), expected.scales)


def test_masked_quantizer_writes_only_rows_below_each_count():
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([5, 0, 2])
    x[1], x[2, 2:] = float("nan"), float("nan")
    got = quantize_activations(x.view(15, HIDDEN).to(DEVICE), SCHEME, counts.to(DEVICE), 5)
    for expert, count in enumerate(counts.tolist()):
        expected = quantize_token_groups(x[expert, :count])
        rows = slice(expert * 5, expert * 5 + count)
        assert torch.equal(got.values[rows].cpu().view(torch.uint8), expected.values.view(torch.uint8))
        assert torch.equal(got.scales[rows].cpu(), expected.scales)


# ------------------------------------------------------------------------------------------- GEMMs

@pytest.mark.parametrize("block_k,tokens", [(128, 7), (64, 1), (32, 20), (128, 0)])
def test_fp8_activation_linear(kernels, block_k, tokens):
    generator = torch.Generator().manual_seed(block_k + tokens)
    weight = random_fp8_weight(40, HIDDEN, block_k, generator)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    values, scale = on_device(weight.values, weight.scale)
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        got = kernels.fp8_linear(strided(x_d), values, scale, block_k)
        assert got.shape == (tokens, 40) and got.dtype == dtype
        check(got, fp8_activation_linear(x_d.cpu(), weight.values, weight.scale, block_k),
              ORACLE.fp8_linear(x_d.cpu().float(), weight.values, weight.scale, block_k), dtype)


@pytest.mark.parametrize("block_k,counts", [(128, [3, 0, 5]), (64, [17, 1, 0])])
def test_fp8_activation_expert_mlp(kernels, block_k, counts):
    generator = torch.Generator().manual_seed(block_k + sum(counts))
    experts = random_fp8_experts(3, HIDDEN, INTERMEDIATE, block_k, generator)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), HIDDEN, generator=generator)
    weights = on_device(*experts.args()[:4])
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        got = kernels.fp8_expert_mlp(x_d, counts.to(DEVICE), *weights, block_k)
        assert got.shape == x.shape and got.dtype == dtype
        check(got, fp8_activation_expert_mlp(x_d.cpu(), counts, *experts.args()),
              ORACLE.fp8_expert_mlp(x_d.cpu().float(), counts, *experts.args()), dtype)


# M = 20 with BLOCK_M 16: two row tiles per expert. Counts: M, one past a tile, 0, past M (read as M).
def test_fp8_activation_masked_expert_mlp_reads_counts_on_the_device(kernels):
    block_k = 128
    generator = torch.Generator().manual_seed(3)
    experts = random_fp8_experts(4, HIDDEN, INTERMEDIATE, block_k, generator)
    counts, given = torch.tensor([20, 17, 0, 20]), torch.tensor([20, 17, 0, 23])
    x = torch.randn(4, 20, HIDDEN, generator=generator)
    x[1, 17:], x[2] = float("nan"), float("inf")                             # stale rows
    weights = on_device(*experts.args()[:4])
    for dtype in DTYPES:
        x_d = x.to(DEVICE, dtype)
        with HostReadWatch(min_fill_elements=x.numel()) as watch:
            got = kernels.fp8_masked_expert_mlp(x_d, given.to(DEVICE), *weights, block_k)
        assert watch.host_reads == [] and watch.fills == [], (watch.host_reads, watch.fills)
        assert got.shape == x.shape and got.dtype == dtype
        expected = fp8_activation_masked_expert_mlp(x_d.cpu(), counts, *experts.args())
        weight_only = ORACLE.fp8_masked_expert_mlp(torch.nan_to_num(x_d.cpu().float()), counts, *experts.args())
        valid = torch.arange(20)[None, :] < counts[:, None]                   # rows past a count: undefined
        check(got.cpu()[valid], expected[valid], weight_only[valid], dtype)


@pytest.mark.parametrize("block_k", [48, 16])
def test_weights_whose_blocks_do_not_fit_the_tile_keep_the_dequantize_path(kernels, block_k):
    """gcd(128, block_k) < 32: no K tile sits in one activation group, one weight block and an 8-bit MMA."""
    assert SCHEME.dot_block_k(HIDDEN, block_k) is None
    generator = torch.Generator().manual_seed(block_k)
    weight = random_fp8_weight(40, HIDDEN, block_k, generator)
    experts = random_fp8_experts(2, HIDDEN, INTERMEDIATE, block_k, generator)
    x = torch.randn(5, HIDDEN, generator=generator)
    counts = torch.tensor([2, 3])
    got = kernels.fp8_linear(*on_device(x, weight.values, weight.scale), block_k)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_linear(x, weight.values, weight.scale, block_k),
                               rtol=1e-4, atol=1e-4)
    got = kernels.fp8_expert_mlp(*on_device(x, counts, *experts.args()[:4]), block_k)
    torch.testing.assert_close(got.cpu(), ORACLE.fp8_expert_mlp(x, counts, *experts.args()), rtol=1e-4, atol=1e-4)
