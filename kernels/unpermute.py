"""Weighted combine of expert outputs back into token order."""
from __future__ import annotations

import torch

from .permute import PermutePlan


def unpermute_reduce(
    out_sorted: torch.Tensor,   # [N, H] expert outputs in the plan's sorted order
    plan: PermutePlan,
    weights: torch.Tensor,      # [T, K] float32 routing weights
    num_tokens: int,
) -> torch.Tensor:              # [T, H] = sum_k weights[t, k] * out of pair (t, k); dropped pairs add 0
    if out_sorted.shape[0] != plan.num_rows:
        raise ValueError(f"out_sorted has {out_sorted.shape[0]} rows but the plan has {plan.num_rows}")
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"weights must be [T={num_tokens}, K], got shape {tuple(weights.shape)}")
    top_k, hidden = weights.shape[1], out_sorted.shape[1]
    flat_weights = weights.reshape(-1).float()                              # [T*K]
    # Scatter rows to their (token, k) slot, then sum over k: deterministic, fp32 accumulation.
    slots = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=out_sorted.device)  # [T*K, H]
    slots[plan.flat_index] = out_sorted.float() * flat_weights[plan.flat_index].unsqueeze(1)
    return slots.view(num_tokens, top_k, hidden).sum(dim=1).to(out_sorted.dtype)
