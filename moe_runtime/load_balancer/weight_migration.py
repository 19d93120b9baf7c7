"""Copy expert weights between ranks to realise a MigrationPlan (point-to-point, staged).

Received weights are staged in the layer's `ExpertStore`, never written in place: a slot may be
the source of another copy, and a failed migration must leave the placement in force untouched.
The store's `commit` swaps them in once every rank agreed.
"""
from __future__ import annotations

import torch.distributed as dist

from moe_runtime.load_balancer.expert_store import ExpertStore
from moe_runtime.load_balancer.migration import MigrationPlan
from moe_runtime.load_balancer.placement import Placement


def source_slot(previous: Placement, layer: int, expert: int, rank: int) -> int:
    """A slot on `rank` that holds `expert` in `previous`."""
    for slot in previous.log2phy[layer, expert].tolist():
        if slot >= 0 and previous.geometry.rank_of_slot(slot) == rank:
            return slot
    raise ValueError(f"layer {layer}: rank {rank} holds no replica of expert {expert} to send")


def migrate_layer(plan: MigrationPlan, previous: Placement, moe_layer: int, store: ExpertStore, rank: int,
                  group) -> None:
    """Run this rank's sends and receives for one MoE layer, staging what it receives in `store`.

    Every rank calls this for the same layers in the same order; copies are tagged by their index
    in the plan. The plan's ranks, and `rank`, are ranks within `group` (the EP data group), not
    global ranks: with pipeline stages the two differ.
    """
    geometry = previous.geometry
    requests, receives = [], []
    in_layer = (plan.layer == moe_layer).nonzero().flatten().tolist()
    for index in in_layer:
        slot, expert = int(plan.slot[index]), int(plan.expert[index])
        src, dst = int(plan.src_rank[index]), int(plan.dst_rank[index])
        if rank not in (src, dst):
            continue
        if src == rank:
            packed = store.read_slot(geometry.local_index(source_slot(previous, moe_layer, expert, rank)))
            if dst == rank:
                store.stage(geometry.local_index(slot), expert, packed)
                continue
            requests.append(dist.isend(packed, group=group, tag=index, group_dst=dst))
        else:
            buffer = store.empty_slot()
            requests.append(dist.irecv(buffer, group=group, tag=index, group_src=src))
            receives.append((geometry.local_index(slot), expert, buffer))
    for request in requests:
        request.wait()
    for local_slot, expert, buffer in receives:
        store.stage(local_slot, expert, buffer)
