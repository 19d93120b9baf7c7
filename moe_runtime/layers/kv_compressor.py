"""DeepSeek-V4's KV compressor: one entry per window of `rate` tokens (CSA: 4, HCA: 128), the lightning indexer's
keys the same way (transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor / DeepseekV4Indexer).

Each token projects a kv row and a gate row (`wkv`, `wgate`); entry w is the per-channel softmax(gate + ape)-weighted
sum of its window's kv rows, RMS-normed (`norm`) and rotated at the window's first position. An overlapping
compressor (CSA) projects two series per token: entry w mixes the first series of window w - 1 with the second of
window w over 2 * rate slots (window 0 only its own). The projections are what a sequence carries between steps
(moe_runtime/layers/compressed_cache.py): this module only projects tokens and compresses complete windows of a
projection series.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.layers.linear import Linear
from moe_runtime.layers.v4_rotary import V4Rotary


class WeightedNorm(nn.Module):
    """RMSNorm in float32 with a float32 weight, the result in the input's dtype (transformers' DeepseekV4RMSNorm)."""

    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class KVCompressor(nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlapping: bool, eps: float, rotary: V4Rotary,
                 dtype, device, quant=None):
        super().__init__()
        self.head_dim, self.rate, self.overlapping = head_dim, rate, overlapping
        width = (2 if overlapping else 1) * head_dim
        self.wkv = Linear(hidden_size, width, False, dtype, device, quant=quant)
        self.wgate = Linear(hidden_size, width, False, dtype, device, quant=quant)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32, device=device), requires_grad=False)
        self.norm = WeightedNorm(head_dim, eps, device)
        self.rotary = rotary

    def project(self, x: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, 2 * width]: kv | gate
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def compress(self, series: torch.Tensor, series_start: int, first: int, stop: int) -> torch.Tensor:
        """Entries [first, stop) [n, head_dim] from `series` [L, 2 * width]: the projections of positions
        series_start, series_start + 1, ..., which must cover every position those entries mix."""
        rate, hd = self.rate, self.head_dim
        width = self.ape.shape[1]
        device = series.device
        windows = torch.arange(first, stop, device=device)                                   # [n]
        offsets = torch.arange(rate, device=device)
        own = windows[:, None] * rate + offsets[None, :] - series_start                        # [n, rate]
        kv, gate = series[own, :width], series[own, width:].float() + self.ape                 # [n, rate, width]
        if self.overlapping:
            previous = (own - rate).clamp(min=0)
            has_previous = (windows > 0)[:, None, None]                                        # [n, 1, 1]
            kv_prev = torch.where(has_previous, series[previous, :hd], 0.0)
            gate_prev = series[previous, width:width + hd].float() + self.ape[:, :hd]
            gate_prev = gate_prev.masked_fill(~has_previous, float("-inf"))
            kv = torch.cat([kv_prev, kv[..., hd:]], dim=1)                                     # [n, 2 rate, hd]
            gate = torch.cat([gate_prev, gate[..., hd:]], dim=1)
        weights = gate.softmax(dim=1).to(kv.dtype)
        entries = self.norm((kv * weights).sum(dim=1))                                         # [n, hd]
        return self.rotary.rotate(entries[:, None, :], windows * rate)[:, 0, :]
