"""Triton grouped GEMM with expert biases, gpt-oss's clamped SwiGLU and MXFP4 weights, against the float64
oracle (expert_epilogue_reference.py). Collected by test_expert_activation.py: compiled on CUDA, in the
Triton interpreter in a child process on CPU (TRITON_INTERPRET=1 must be set before triton is imported).

Tolerances (relative to the output's largest magnitude): fp32 1e-4 (fp32 summation order only: the MXFP4
tile decode is exact); fp16 / bf16 2e-2 (the activations, the stored gated activation and the outputs are
rounded to 11 / 8 bits).
"""
import pytest
import torch
from expert_epilogue_reference import (LIMIT, activations, biased_experts, clamped_silu_experts_f64, contiguous_f64,
                                       expert_f64)

from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4, quantize_mxfp4
from moe_runtime.kernels.triton_impl.kernel_set import triton_kernel_set

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]
E, H, I = 4, 64, 32
GPT_OSS = ExpertActivation.gpt_oss()
KERNELS = triton_kernel_set()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def on_device(*tensors, dtype=None):
    return [t.to(DEVICE) if dtype is None else t.to(DEVICE, dtype) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_contiguous_experts_with_biases_and_clamps(dtype, mxfp4):
    experts = biased_experts(E, H, I, mxfp4=mxfp4)
    counts = torch.tensor([3, 0, 17, 5])
    x = activations(int(counts.sum()), H)
    assert experts.clamps_bite(x)
    want = contiguous_f64(x, counts, experts.w13, experts.w2, experts.b13, experts.b2)
    xd, countsd = on_device(x.to(dtype), counts)
    b13, b2 = on_device(experts.b13, experts.b2, dtype=dtype)
    if mxfp4:
        w13, w13_scale = on_device(*quantize_mxfp4(experts.w13))
        w2, w2_scale = on_device(*quantize_mxfp4(experts.w2))
        got = KERNELS.mxfp4_expert_mlp(xd, countsd, w13, w13_scale, w2, w2_scale, b13=b13, b2=b2, activation=GPT_OSS)
    else:
        w13, w2 = on_device(experts.w13, experts.w2, dtype=dtype)
        got = KERNELS.expert_mlp(xd, countsd, w13, w2, b13=b13, b2=b2, activation=GPT_OSS)
    assert got.dtype == dtype
    assert relative_error(got, want) < tolerance(dtype)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_masked_experts_with_biases_and_clamps(mxfp4):
    experts = biased_experts(E, H, I, mxfp4=mxfp4)
    counts = torch.tensor([5, 0, 20, 1])
    x = activations(E * 20, H).view(E, 20, H)
    x[0, 7:] = float("nan")                                                 # stale rows: never read
    xd, countsd, b13, b2 = on_device(x, counts, experts.b13, experts.b2)
    if mxfp4:
        w13, w13_scale = on_device(*quantize_mxfp4(experts.w13))
        w2, w2_scale = on_device(*quantize_mxfp4(experts.w2))
        got = KERNELS.mxfp4_masked_expert_mlp(xd, countsd, w13, w13_scale, w2, w2_scale, b13=b13, b2=b2,
                                              activation=GPT_OSS)
    else:
        w13, w2 = on_device(experts.w13, experts.w2)
        got = KERNELS.masked_expert_mlp(xd, countsd, w13, w2, b13=b13, b2=b2, activation=GPT_OSS)
    for e, count in enumerate(counts.tolist()):
        if count:
            want = expert_f64(x[e, :count], experts.w13[e], experts.w2[e], experts.b13[e], experts.b2[e])
            assert relative_error(got[e, :count], want) < 1e-4


def test_silu_experts_with_biases():
    experts = biased_experts(E, H, I)
    counts = torch.tensor([2, 4, 0, 3])
    x = activations(9, H)
    want = contiguous_f64(x, counts, experts.w13, experts.w2, experts.b13, experts.b2, clamped=False)
    got = KERNELS.expert_mlp(*on_device(x, counts, experts.w13, experts.w2), b13=experts.b13.to(DEVICE),
                             b2=experts.b2.to(DEVICE))
    assert relative_error(got, want) < 1e-4


def test_deepseek_v4_clamped_silu_experts():
    """DeepSeek-V4's clamped SiLU in the grouped GEMM's epilogue (no biases), with the clamps biting."""
    experts = biased_experts(E, H, I)
    counts = torch.tensor([3, 0, 17, 5])
    x = activations(int(counts.sum()), H)
    assert experts.clamps_bite(x)
    want = clamped_silu_experts_f64(x, counts, experts.w13, experts.w2)
    got = KERNELS.expert_mlp(*on_device(x, counts, experts.w13, experts.w2),
                             activation=ExpertActivation.deepseek_v4(LIMIT))
    assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize("columns", [64, 40])
def test_mxfp4_tile_decode_is_exact(columns):
    """x = identity: the linear returns every decoded weight as is; every byte value and a range of exponents."""
    rows = 256
    values = torch.arange(rows * (-(-columns // 32)) * 16, dtype=torch.int64).remainder(256).to(torch.uint8)
    values = values.view(rows, -1)
    scales = torch.randint(110, 141, (rows, values.shape[1] // 16), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int64).to(torch.uint8)
    scales[0, 0] = 127
    identity = torch.eye(columns)
    got = KERNELS.mxfp4_linear(*on_device(identity, values, scales))              # [K, N] = W.T
    want = dequantize_mxfp4(values, scales, columns)
    assert torch.equal(got.cpu().T, want)


def test_mxfp4_linear_with_bias():
    weight = torch.randn(48, 96)
    values, scales = quantize_mxfp4(weight)
    bias = torch.randn(48)
    x = activations(5, 96)
    want = x.double() @ dequantize_mxfp4(values, scales, 96).double().T + bias.double()
    got = KERNELS.mxfp4_linear(*on_device(x, values, scales, bias))
    assert relative_error(got, want) < 1e-4
