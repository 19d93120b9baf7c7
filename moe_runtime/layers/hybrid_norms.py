"""The two RMSNorms of the Qwen3-Next family that differ from the usual one.

- `OffsetRMSNorm`: the checkpoint stores w - 1 (initialised at zero) and the layer scales by (1 + w), the
  product taken in fp32 before the cast back (Qwen3-Next and Qwen3.5-MoE: the decoder norms, the final norm,
  the full attention's q/k norms). Loading such a weight into the plain RMSNorm would silently scale by w.
- `GatedRMSNorm`: Gated DeltaNet's output norm, per value head, then multiplied by silu(z) of the layer's own
  gate projection (norm before gate, as fla's FusedRMSNormGated and transformers do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalized(x32: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D] fp32 -> [..., D] fp32
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return (_normalized(x.float(), self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D], [..., D]
        normed = self.weight * _normalized(x.float(), self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)
