"""RMSNorm with Hugging Face semantics (fp32 variance, `weight * normed.to(input dtype)`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NormOutput:
    out: torch.Tensor        # [T, H] normalized
    residual: torch.Tensor   # [T, H] x + residual (the stream the next layer adds to)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> NormOutput:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    summed = x + residual
    return NormOutput(out=rms_norm(summed, weight, eps), residual=summed)
