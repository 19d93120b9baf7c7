"""Float64 oracle for experts with biases and gpt-oss's clamped SwiGLU, and random inputs that make the
clamps bite (shared by test_expert_activation.py, test_mxfp4.py and expert_epilogue_triton_cases.py).

The formula is written out here from transformers' GptOssExperts (`_apply_gate` and `forward`), not taken
from moe_runtime/kernels/expert_activation.py, so the kernels are held against an independent statement of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.kernels.mxfp4_weights import dequantize_mxfp4, quantize_mxfp4

ALPHA, LIMIT = 1.702, 7.0


def clamped_swiglu_f64(gate_up: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """[..., 2I] (gate half, up half) float64 -> [..., I]."""
    intermediate = gate_up.shape[-1] // 2
    gate = gate_up[..., :intermediate].clamp(max=limit)
    up = gate_up[..., intermediate:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_silu_f64(gate_up: torch.Tensor, limit: float = LIMIT) -> torch.Tensor:
    """DeepSeek-V4's (transformers' DeepseekV4Experts._apply_gate): silu(min(gate, limit)) * clamp(up, +-limit)."""
    intermediate = gate_up.shape[-1] // 2
    gate = gate_up[..., :intermediate].clamp(max=limit)
    return gate * torch.sigmoid(gate) * gate_up[..., intermediate:].clamp(min=-limit, max=limit)


def clamped_silu_experts_f64(x_sorted, counts, w13, w2, limit: float = LIMIT) -> torch.Tensor:
    """DeepSeek-V4's bias-free experts on rows sorted by expert ([T, H], counts [E]) -> [T, H] float64."""
    out = torch.zeros(x_sorted.shape[0], w2.shape[1], dtype=torch.float64)
    start = 0
    for e, count in enumerate(counts.tolist()):
        rows = x_sorted[start:start + count].double()
        out[start:start + count] = clamped_silu_f64(rows @ w13[e].double().T, limit) @ w2[e].double().T
        start += count
    return out


def silu_f64(gate_up: torch.Tensor) -> torch.Tensor:
    intermediate = gate_up.shape[-1] // 2
    gate = gate_up[..., :intermediate]
    return gate * torch.sigmoid(gate) * gate_up[..., intermediate:]


def expert_f64(x, w13, w2, b13=None, b2=None, clamped: bool = True) -> torch.Tensor:
    """One expert on rows x [n, H]: w13 [2I, H], w2 [H, I], b13 [2I], b2 [H] -> [n, H] float64."""
    gate_up = x.double() @ w13.double().T + (0 if b13 is None else b13.double())
    activated = clamped_swiglu_f64(gate_up) if clamped else silu_f64(gate_up)
    return activated @ w2.double().T + (0 if b2 is None else b2.double())


def contiguous_f64(x_sorted, counts, w13, w2, b13=None, b2=None, clamped: bool = True) -> torch.Tensor:
    out = torch.zeros(x_sorted.shape[0], w2.shape[1], dtype=torch.float64)
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count:
            out[start:start + count] = expert_f64(x_sorted[start:start + count], w13[e], w2[e],
                                                  None if b13 is None else b13[e], None if b2 is None else b2[e],
                                                  clamped)
        start += count
    return out


@dataclass
class BiasedExperts:
    w13: torch.Tensor   # [E, 2I, H]
    w2: torch.Tensor    # [E, H, I]
    b13: torch.Tensor   # [E, 2I]
    b2: torch.Tensor    # [E, H]

    def clamps_bite(self, x: torch.Tensor) -> bool:
        """Whether, on rows x, some gate exceeds LIMIT and some up falls outside [-LIMIT, LIMIT] for every expert."""
        gate_up = torch.einsum("nh,eih->eni", x.double(), self.w13.double()) + self.b13.double()[:, None]
        intermediate = gate_up.shape[-1] // 2
        return bool((gate_up[..., :intermediate] > LIMIT).any() and (gate_up[..., intermediate:].abs() > LIMIT).any())


def biased_experts(num_experts: int, hidden: int, intermediate: int, seed: int = 0, mxfp4: bool = False,
                   dtype=torch.float32) -> BiasedExperts:
    """Weights whose pre-activations on `activations` rows have std ~6: a good share lands past the clamps.
    With `mxfp4`, w13 / w2 are rounded to MXFP4 values (exactly representable)."""
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * (3.0 / hidden ** 0.5)
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * (1.0 / intermediate ** 0.5)
    b13 = torch.randn(num_experts, 2 * intermediate, generator=generator) * 2.0
    b2 = torch.randn(num_experts, hidden, generator=generator)
    if mxfp4:
        w13 = dequantize_mxfp4(*quantize_mxfp4(w13), hidden)
        w2 = dequantize_mxfp4(*quantize_mxfp4(w2), intermediate)
    return BiasedExperts(w13.to(dtype), w2.to(dtype), b13.to(dtype), b2.to(dtype))


def activations(rows: int, hidden: int, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * 2.0).to(dtype)
