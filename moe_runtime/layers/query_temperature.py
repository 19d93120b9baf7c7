"""Attention temperature tuning (Llama 4, arXiv 2501.19399): a layer without rotary scales each query by a factor
that grows with the log of its position, so attention stays sharp over long contexts where a NoPE layer's
scores would otherwise flatten."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QueryTemperature:
    """q at position p is multiplied by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (transformers'
    Llama4TextAttention: 1 for the first floor_scale - 1 positions, then rising by steps of floor_scale)."""

    attn_scale: float
    floor_scale: float

    def scales(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T] fp32
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def apply(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [T], [T, heads, D] -> same
        """The queries scaled row by row, in fp32 and back to q's dtype (as transformers multiplies them)."""
        return (q * self.scales(positions)[:, None, None]).to(q.dtype)
