"""RMSNorm with HF semantics (fp32 variance), computed by the selected kernel set; LayerNorm with weight and bias."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.rms_norm(x, self.weight, self.eps)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D] -> [..., D]
    """x / rms(x) over the last dim in fp32, no weight: Llama 4's q/k "L2 norm" (transformers' Llama4TextL2Norm is
    this mean-of-squares form, not a unit-length L2 normalization)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (DeepSeek-V3.2's indexer keys), torch's own kernel as transformers runs it."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D]
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
