"""The expert MLP's gated activation between its two projections, as a value the kernels carry.

Every expert kernel computes gate_up = x @ w13.T (+ b13), then `activation(gate, up)`, then
@ w2.T (+ b2). Which activation is a property of the model's experts (`ExpertWeights.activation`),
so dispatchers and kernel families stay generic: they pass this frozen value through, and each
family implements both kinds (torch here, Triton in the grouped GEMM's epilogue, the reference in
float64-friendly plain ops).

- "silu": silu(gate) * up (Mixtral, Qwen, DeepSeek, ... every SwiGLU model).
- "gpt_oss_clamped_swiglu": gpt-oss's variant (transformers' GptOssExperts._apply_gate): gate
  clamped to at most `limit`, up clamped to [-limit, limit], glu = gate * sigmoid(alpha * gate),
  out = (up + 1) * glu. The clamp keeps the activation bounded for huge pre-activations, which the
  published checkpoints rely on; the +1 on up means an expert whose up half is zero still passes glu.

- "clamped_silu": DeepSeek-V4's (transformers' DeepseekV4Experts._apply_gate, and its shared expert): gate clamped
  to at most `limit`, up clamped to [-limit, limit], then silu(gate) * up (no alpha, no +1).

w13's rows are gate rows then up rows (`gate_up[..., :I]`, `gate_up[..., I:]`) whatever the
checkpoint's order: gpt-oss's interleaved columns are separated at load (moe/expert_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATION_KINDS = ("silu", "gpt_oss_clamped_swiglu", "clamped_silu")


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"
    alpha: float = 1.702      # gpt_oss_clamped_swiglu: sigmoid(alpha * gate)
    limit: float = 7.0        # gpt_oss_clamped_swiglu: the clamp bound

    def __post_init__(self):
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"ExpertActivation.kind must be one of {ACTIVATION_KINDS}, got {self.kind!r}")
        if self.kind != "silu" and not self.limit > 0:
            raise ValueError(f"ExpertActivation.limit must be positive, got {self.limit}")

    @classmethod
    def gpt_oss(cls, alpha: float = 1.702, limit: float = 7.0) -> "ExpertActivation":
        """gpt-oss's clamped SwiGLU (config `swiglu_limit`; alpha is fixed at 1.702 in transformers)."""
        return cls("gpt_oss_clamped_swiglu", float(alpha), float(limit))

    @classmethod
    def deepseek_v4(cls, limit: float) -> "ExpertActivation":
        """DeepSeek-V4's clamped SiLU (config `swiglu_limit`)."""
        return cls("clamped_silu", limit=float(limit))

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[..., I] gate and up -> [..., I], in their dtype (new tensor; gate / up untouched)."""
        if self.is_silu:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        if self.kind == "clamped_silu":
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def on_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gate half, then up half) -> [..., I]."""
        intermediate = gate_up.shape[-1] // 2
        if self.is_silu:   # in place on the gate half's result: the hot CPU path of every SwiGLU model
            return F.silu(gate_up[..., :intermediate]).mul_(gate_up[..., intermediate:])
        return self.apply(gate_up[..., :intermediate], gate_up[..., intermediate:])


def add_bias_(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out [..., N] += bias [N] (in out's dtype) when there is one; returns out."""
    if bias is not None:
        out.add_(bias.to(out.dtype))
    return out
