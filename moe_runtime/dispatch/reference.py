"""The naive oracle for the dispatch contract: every expert on every token, weighted sum."""

from __future__ import annotations

from typing import Callable

import torch


def naive_moe_reference(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                        num_slots: int,
                        expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """y[t] = sum_k weights[t, k] * expert_fn(slot_ids[t, k], x)[t]; masked slots (< 0) add 0.

    x [T, H], slot_ids [T, K], weights [T, K]; expert_fn(slot, x [T, H]) -> [T, H]. No routing
    shortcuts: each expert runs on all T tokens and the weights select, so the oracle shares no
    grouping logic with the dispatchers it checks. Accumulates in float64.
    """
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)   # [T, H]
    for slot in range(num_slots):
        out = expert_fn(slot, x).to(torch.float64)                     # [T, H]
        weight = torch.where(slot_ids == slot, weights.to(torch.float64), 0.0).sum(dim=1)  # [T]
        y += weight.unsqueeze(1) * out
    return y.to(x.dtype)
