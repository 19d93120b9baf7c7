"""All experts on one device in one call: permute -> grouped expert MLP -> weighted unpermute.

The engine runs MoE layers through moe_runtime/moe/ (a dispatcher x an expert kernel, the local
dispatcher on one rank) and does not call this; it stays a tested kernel of its own and the GPU
check's reference for the grouped path, with a direct path for decode at batch 1-2.
"""
from __future__ import annotations

import torch

from .expert_mlp import check_expert_weights, expert_mlp
from .permute import permute_by_expert
from .skinny_matmul import linear_rows
from .unpermute import unpermute_reduce


DIRECT_PAIRS_MAX = 8  # (token, k) pairs below which sorting costs more than it saves (decode at batch 1-2)


def _direct_small_batch(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """A handful of (token, expert) pairs: run each expert on its token directly, no permutation."""
    intermediate = check_expert_weights(x.shape[-1], w13, w2)
    out = torch.zeros_like(x)                                              # [T, H]
    num_experts = w13.shape[0]
    for token, (experts, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        row = x[token : token + 1]                                         # [1, H]
        for expert, weight in zip(experts, weights):
            if not 0 <= expert < num_experts:
                continue                                                   # masked slot
            gate_up = linear_rows(row, w13[expert])                        # [1, 2I]
            hidden = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            out[token : token + 1].add_(linear_rows(hidden, w2[expert]), alpha=weight)
    return out


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
    if topk_ids.numel() <= DIRECT_PAIRS_MAX and x.device.type == "cpu":
        return _direct_small_batch(x, w13, w2, topk_weights, topk_ids)
    plan = permute_by_expert(topk_ids, w13.shape[0])
    out_sorted = expert_mlp(x[plan.token_index], plan.counts, w13, w2)     # [N, H]
    return unpermute_reduce(out_sorted, plan, topk_weights, x.shape[0])
