"""Gated DeltaNet's short causal convolution (depthwise, kernel K, SiLU) over a step's flattened tokens, each
sequence continuing from the K-1 inputs its state slot kept (moe_runtime/layers/state_cache.py) and leaving its
last K-1 there: a prefill split into chunks convolves exactly as one piece."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel: int, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, query_start: list[int], slots: list[int],
                conv_state: torch.Tensor) -> torch.Tensor:  # [T, C] -> [T, C]
        """`conv_state` [slots, C, K-1] is read and updated in place; sequence b owns rows
        [query_start[b], query_start[b + 1]) and state slot slots[b]."""
        out = torch.empty_like(x)
        width = conv_state.shape[-1]
        weight = self.weight[:, 0, :]                                             # [C, K]
        single = [b for b in range(len(slots)) if query_start[b + 1] - query_start[b] == 1]
        if single:                                                                # decodes: one gather, one sum
            rows = torch.tensor([query_start[b] for b in single], device=x.device)
            index = torch.tensor([slots[b] for b in single], device=x.device)
            window = torch.cat([conv_state[index], x[rows, :, None].to(conv_state.dtype)], dim=-1)   # [S, C, K]
            out[rows] = F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
            conv_state[index] = window[:, :, 1:]
        for b in range(len(slots)):
            start, stop = query_start[b], query_start[b + 1]
            if stop - start <= 1:
                continue
            full = torch.cat([conv_state[slots[b]], x[start:stop].T.to(conv_state.dtype)], dim=-1)  # [C, K-1+L]
            mixed = F.conv1d(full[None].to(weight.dtype), self.weight, groups=full.shape[0])[0]      # [C, L]
            out[start:stop] = F.silu(mixed).T.to(x.dtype)
            conv_state[slots[b]] = full[:, full.shape[1] - width:]
        return out
