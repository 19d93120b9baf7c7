"""The MoE router: one linear layer from hidden states to a logit per logical expert.

gpt-oss's router has a bias (`router.bias` [E], `bias=True`); its choice (top-k of the logits, softmax
over the chosen k) is `RoutingConfig(top_k, scoring="softmax", renormalize=True)` (moe_runtime/kernels/routing.py).
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.kernels.skinny_matmul import linear_rows
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import copy_checked


class Router(nn.Module):
    """Router logits in fp32 (as transformers computes them for every MoE architecture here)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, dtype, device=None,
                 bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)
            if correction_bias else None
        )
        self.matmul = linear_rows   # the kernel family's, bound when the model is built (registry.py)

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        copy_checked(self.weight, reader.read(f"{prefix}weight"), f"{prefix}weight", reader.directory)
        loaded = {"weight"}
        if self.bias is not None:
            copy_checked(self.bias, reader.read(f"{prefix}bias"), f"{prefix}bias", reader.directory)
            loaded.add("bias")
        if self.e_score_correction_bias is not None:
            name = f"{prefix}e_score_correction_bias"
            copy_checked(self.e_score_correction_bias, reader.read(name), name, reader.directory)
            loaded.add("e_score_correction_bias")
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32
        return self.matmul(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
