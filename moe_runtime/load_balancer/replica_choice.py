"""Logical expert ids -> physical slots, per token, on the step path.

What one rank needs of a placement to choose replicas is a `ReplicaTable` per MoE layer, on the
step's device (the router's ids live there). The tables are built once per placement
(`replica_tables`), when it comes into force, never per step: the CPU placement is never indexed
with device ids, and no step recomputes which replicas are local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.load_balancer.placement import Placement


@dataclass(frozen=True)
class ReplicaTable:
    """One MoE layer's logical -> physical map as one rank uses it, on that rank's device."""

    log2phy: torch.Tensor     # [E, R] long: slots of each logical expert, -1 padded
    logcnt: torch.Tensor      # [E] long: replica count
    local_slot: torch.Tensor  # [E] long: the slot of each expert on this rank, -1 where it has none here
    rank: int                 # the rank (in the EP group) the table was built for
    is_identity: bool         # no replicas and expert e on slot e: ids are slots

    @property
    def has_replicas(self) -> bool:
        return self.log2phy.shape[1] > 1


def local_replica_slots(placement: Placement, layer: int, rank: int) -> torch.Tensor:
    """[E] long: the slot of each expert of `layer` on `rank`, -1 where it has none there."""
    log2phy = placement.log2phy[layer]  # [E, R]
    on_rank = placement.geometry.rank_of(log2phy) == rank  # [E, R]; padding (-1) is on no rank
    # Replicas never share a rank, so at most one entry per row matches.
    return torch.where(on_rank.any(-1), (log2phy * on_rank).sum(-1), torch.full_like(log2phy[:, 0], -1))


def replica_table(placement: Placement, layer: int, rank: int, device: torch.device | str) -> ReplicaTable:
    return ReplicaTable(
        log2phy=placement.log2phy[layer].to(device),
        logcnt=placement.logcnt[layer].to(device),
        local_slot=local_replica_slots(placement, layer, rank).to(device),
        rank=rank,
        is_identity=placement.is_identity(layer),
    )


def replica_tables(placement: Placement, rank: int, device: torch.device | str) -> list[ReplicaTable]:
    """One table per MoE layer of `placement`, for `rank`, on `device` (once per placement)."""
    return [replica_table(placement, layer, rank, device) for layer in range(placement.num_layers)]


def choose_replicas(logical_ids: torch.Tensor, table: ReplicaTable) -> torch.Tensor:  # [T, K] -> [T, K]
    """[T, K] int64 physical slot for every (token, k); no host syncs, no Python loop.

    A replica on the table's rank is taken when there is one (no network hop). Otherwise token t
    uses replica (t + rank) % logcnt: tokens spread evenly over the replicas, and ranks with few
    tokens start at different replicas. When the placement is the identity the input is
    returned as it is.
    """
    if logical_ids.dim() != 2:
        raise ValueError(f"logical_ids must be [tokens, top_k], got shape {tuple(logical_ids.shape)}")
    if table.is_identity:
        return logical_ids
    if not table.has_replicas:  # one slot per expert: a plain lookup
        return table.log2phy[:, 0][logical_ids]
    count = table.logcnt[logical_ids]  # [T, K]
    token = torch.arange(logical_ids.shape[0], device=logical_ids.device).unsqueeze(1) + table.rank  # [T, 1]
    spread = table.log2phy[logical_ids, token % count]  # [T, K]
    local = table.local_slot[logical_ids]  # [T, K]
    return torch.where(local >= 0, local, spread)
