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
    if plan.num_rows == 0:
        return torch.zeros(num_tokens, hidden, dtype=out_sorted.dtype, device=out_sorted.device)
    # Gather each (token, k) pair's row (dropped pairs read row 0 with weight 0), then one batched
    # [1, K] @ [K, H] per token: no [T*K, H] zero-fill or scatter, fp32 accumulation.
    row_of_pair = torch.zeros(num_tokens * top_k, dtype=torch.int64, device=out_sorted.device)      # [T*K]
    row_of_pair[plan.flat_index] = torch.arange(plan.num_rows, device=out_sorted.device)
    kept_weights = torch.zeros(num_tokens * top_k, dtype=torch.float32, device=out_sorted.device)   # [T*K]
    kept_weights[plan.flat_index] = weights.reshape(-1).float()[plan.flat_index]
    pair_rows = out_sorted[row_of_pair].view(num_tokens, top_k, hidden)                               # [T, K, H]
    if pair_rows.dtype != torch.float32:
        pair_rows = pair_rows.float()
    y = torch.bmm(kept_weights.view(num_tokens, 1, top_k), pair_rows)                                 # [T, 1, H]
    return y.view(num_tokens, hidden).to(out_sorted.dtype)
