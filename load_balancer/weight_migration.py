"""Copy expert weights between ranks to realise a MigrationPlan (point-to-point, staged).

Received weights are staged, never written in place: a slot may be the source of another copy,
and a failed migration must leave the placement in force untouched. `commit_staged` swaps them in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from load_balancer.migration import MigrationPlan
from load_balancer.placement import Placement


@dataclass
class StagedExpert:
    local_slot: int
    expert: int
    w13: torch.Tensor  # [2I, H]
    w2: torch.Tensor   # [H, I]


def source_slot(previous: Placement, layer: int, expert: int, rank: int) -> int:
    """A slot on `rank` that holds `expert` in `previous`."""
    slots_per_rank = previous.slots_per_rank
    for slot in previous.log2phy[layer, expert].tolist():
        if slot >= 0 and slot // slots_per_rank == rank:
            return slot
    raise ValueError(f"layer {layer}: rank {rank} holds no replica of expert {expert} to send")


def migrate_layer(plan: MigrationPlan, previous: Placement, moe_layer: int, experts, rank: int,
                  group) -> list[StagedExpert]:
    """Run this rank's sends and receives for one MoE layer; return the copies it must commit.

    `experts` is the layer's StackedExperts (w13 [E_local, 2I, H], w2 [E_local, H, I]). Every rank
    calls this for the same layers in the same order; copies are tagged by their index in the plan.
    The plan's ranks, and `rank`, are ranks within `group` (the EP data group), not global ranks:
    with pipeline stages the two differ.
    """
    slots_per_rank = previous.slots_per_rank
    w13, w2 = experts.w13.data, experts.w2.data
    rows13, rows2 = w13[0].numel(), w2[0].numel()
    staged: list[StagedExpert] = []
    requests, receives = [], []
    in_layer = (plan.layer == moe_layer).nonzero().flatten().tolist()
    for index in in_layer:
        slot, expert = int(plan.slot[index]), int(plan.expert[index])
        src, dst = int(plan.src_rank[index]), int(plan.dst_rank[index])
        if rank not in (src, dst):
            continue
        if src == rank:
            local_src = source_slot(previous, moe_layer, expert, rank) % slots_per_rank
            if dst == rank:
                staged.append(StagedExpert(slot % slots_per_rank, expert, w13[local_src].clone(), w2[local_src].clone()))
                continue
            packed = torch.cat([w13[local_src].reshape(-1), w2[local_src].reshape(-1)])
            requests.append(dist.isend(packed, group=group, tag=index, group_dst=dst))
        else:
            buffer = torch.empty(rows13 + rows2, dtype=w13.dtype, device=w13.device)
            requests.append(dist.irecv(buffer, group=group, tag=index, group_src=src))
            receives.append((slot % slots_per_rank, expert, buffer))
    for request in requests:
        request.wait()
    for local_slot, expert, buffer in receives:
        staged.append(StagedExpert(local_slot, expert, buffer[:rows13].view_as(w13[0]), buffer[rows13:].view_as(w2[0])))
    return staged


def commit_staged(experts, staged: list[StagedExpert]) -> None:
    """Write staged copies into their slots (after every rank agreed the migration succeeded)."""
    with torch.no_grad():
        for copy in staged:
            experts.w13.data[copy.local_slot].copy_(copy.w13)
            experts.w2.data[copy.local_slot].copy_(copy.w2)
            experts.expert_ids[copy.local_slot] = copy.expert
