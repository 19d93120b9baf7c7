"""The placement a job keeps when ranks are lost: every surviving slot as it is, and each expert that no survivor
holds put into a slot reclaimed from a redundant replica, to be loaded there from the checkpoint.

Pure planning on what the survivors hold (`held`, gathered from them after they re-formed), not on the placement
they last agreed on: a rank lost in the middle of a rebalance may leave survivors that committed it and survivors
that did not, and what each slot really holds is the only truth they share. No expert weight crosses ranks: a
survivor's slots keep their experts, and a reclaimed slot reads its new expert from the checkpoint, so the plan
needs no surviving copy of the lost rank's weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.load_balancer.placement import Placement


class ExpertsLost(ValueError):
    """The survivors cannot hold every expert: too few slots, or too few redundant replicas to reclaim."""


@dataclass(frozen=True)
class SlotReload:
    """Slot `slot` of MoE layer `layer` (a slot of the survivors' placement) loads `expert` from the checkpoint."""

    layer: int
    slot: int
    expert: int


@dataclass(frozen=True)
class SurvivorPlacement:
    placement: Placement
    reloads: list[SlotReload]


def survivor_placement(held: torch.Tensor, num_experts: int, num_ranks: int, num_nodes: int = 1,
                       load: torch.Tensor | None = None) -> SurvivorPlacement:
    """`held` [L, P'] long: the expert each slot of the `num_ranks` survivors holds, survivors in their new rank
    order (P' = num_ranks x slots per rank). An expert without a surviving replica takes the slot of a replica of
    the expert with the most replicas (ties: the least loaded by `load` [L, E], then the lowest id; its highest
    slot), so the hottest experts keep their replicas. Raises `ExpertsLost` naming the layer and experts when the
    survivors cannot hold them all."""
    held = torch.as_tensor(held, dtype=torch.long).cpu()
    num_layers, num_slots = held.shape
    if num_slots < num_experts:
        raise ExpertsLost(f"the {num_ranks} surviving ranks hold {num_slots} expert slots per MoE layer, fewer than "
                          f"the model's {num_experts} experts (more --num-redundant-experts would let them)")
    phy2log = held.clone()
    reloads: list[SlotReload] = []
    for layer in range(num_layers):
        counts = torch.bincount(phy2log[layer], minlength=num_experts)       # [E]
        orphans = (counts == 0).nonzero().flatten().tolist()   # as many redundant replicas as these: P' >= E
        layer_load = load[layer] if load is not None else torch.zeros(num_experts)
        for orphan in orphans:
            donor = max(range(num_experts), key=lambda e: (int(counts[e]), -float(layer_load[e]), -e))
            slot = int((phy2log[layer] == donor).nonzero().flatten()[-1])
            phy2log[layer, slot] = orphan
            counts[donor] -= 1
            counts[orphan] += 1
            reloads.append(SlotReload(layer, slot, orphan))
    return SurvivorPlacement(Placement.from_phy2log(phy2log, num_experts, num_ranks, num_nodes), reloads)
