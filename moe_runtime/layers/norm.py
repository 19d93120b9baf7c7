"""RMSNorm with HF semantics (fp32 variance), computed by the selected kernel set."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.rms_norm(x, self.weight, self.eps)
