"""Grouping (token, k) pairs by expert into contiguous segments (the layout the grouped GEMM reads)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PermutePlan:
    token_index: torch.Tensor   # [N] int64: source token of each row of the expert-sorted layout
    flat_index: torch.Tensor    # [N] int64: position in the flattened [T*K] (token, k) list of each sorted row
    counts: torch.Tensor        # [E] int64 rows per expert (segments are contiguous, in expert order)
    offsets: torch.Tensor       # [E+1] int64 exclusive prefix sum of counts

    @property
    def num_rows(self) -> int:
        return self.token_index.shape[0]


def offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """[E] -> [E+1] exclusive prefix sum."""
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return offsets


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int) -> PermutePlan:
    """Stable sort of the (token, k) pairs by expert id.

    Ids outside [0, num_experts) mark masked slots (e.g. experts living on another rank) and are
    dropped: they get no row, so N = number of valid pairs <= T*K.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()                                  # [T*K]
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    keys = torch.where(valid, flat_ids, torch.full_like(flat_ids, num_experts))  # dropped -> sentinel bucket
    order = torch.sort(keys, stable=True).indices                          # [T*K]
    counts = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]  # [E]
    offsets = offsets_from_counts(counts)
    num_rows = int(offsets[-1])
    flat_index = order[:num_rows]                                          # [N]
    return PermutePlan(
        token_index=flat_index // max(top_k, 1),
        flat_index=flat_index,
        counts=counts,
        offsets=offsets,
    )
