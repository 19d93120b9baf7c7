"""Logical expert ids -> physical slots, per token, on the hot path."""

from __future__ import annotations

from typing import Union

import torch

from load_balancer.placement import LayerPlacement


def local_replica_slots(log2phy: torch.Tensor, my_rank: int, slots_per_rank: int) -> torch.Tensor:
    """[E] long: the slot of each expert on `my_rank`, -1 where it has none there."""
    on_mine = (log2phy >= 0) & (log2phy // slots_per_rank == my_rank)  # [E, R]
    # Replicas never share a rank, so at most one entry per row matches.
    return torch.where(on_mine.any(-1), (log2phy * on_mine).sum(-1), torch.full_like(log2phy[:, 0], -1))


def choose_replicas(
    logical_ids: torch.Tensor,  # [T, K] int64
    layer_placement: Union[LayerPlacement, tuple],  # LayerPlacement or (log2phy [E, R], logcnt [E])
    my_rank: int,
    slots_per_rank: int,
) -> torch.Tensor:
    """[T, K] int64 physical slot for every (token, k); no host syncs, no Python loop.

    A replica on `my_rank` is taken when there is one (no network hop). Otherwise
    token t uses replica (t + my_rank) % logcnt: tokens spread evenly over the
    replicas, and ranks with few tokens start at different replicas. When the
    placement is the identity the input is returned as it is.
    """
    if isinstance(layer_placement, LayerPlacement):
        log2phy, logcnt, identity = layer_placement.log2phy, layer_placement.logcnt, layer_placement.is_identity
    else:
        (log2phy, logcnt), identity = layer_placement, False
    if logical_ids.dim() != 2:
        raise ValueError(f"logical_ids must be [tokens, top_k], got shape {tuple(logical_ids.shape)}")
    if identity:
        return logical_ids
    if log2phy.shape[1] == 1:  # no replicas anywhere: a plain lookup
        return log2phy[:, 0][logical_ids]
    count = logcnt[logical_ids]  # [T, K]
    token = torch.arange(logical_ids.shape[0], device=logical_ids.device).unsqueeze(1) + my_rank  # [T, 1]
    spread = log2phy[logical_ids, token % count]  # [T, K]
    local = local_replica_slots(log2phy, my_rank, slots_per_rank)[logical_ids]  # [T, K]
    return torch.where(local >= 0, local, spread)
