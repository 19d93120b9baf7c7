"""Single-rank MoE expert computation: permute -> grouped expert MLP -> weighted unpermute."""
from __future__ import annotations

import torch

from .expert_mlp import expert_mlp
from .permute import permute_by_expert
from .unpermute import unpermute_reduce


def fused_moe(
    x: torch.Tensor,             # [T, H]
    w13: torch.Tensor,           # [E, 2I, H]
    w2: torch.Tensor,            # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,      # [T, K] int64; ids outside [0, E) are skipped
) -> torch.Tensor:               # [T, H]
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, K]"
        )
    plan = permute_by_expert(topk_ids, w13.shape[0])
    out_sorted = expert_mlp(x[plan.token_index], plan.counts, w13, w2)     # [N, H]
    return unpermute_reduce(out_sorted, plan, topk_weights, x.shape[0])
