"""Which expert weights must be copied to go from one placement to another.

Pure planning, no communication: the executor (future multi-rank engine
workers) copies `expert` from `src_rank` into `slot` on `dst_rank` for every
entry. Sources refer to the previous placement, so an executor that writes
slots in place must read every source before overwriting it (or stage copies
in a spare buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.load_balancer.placement import Placement


@dataclass(frozen=True)
class MigrationPlan:
    layer: torch.Tensor  # [M] long: MoE layer of each copy
    slot: torch.Tensor  # [M] long: physical slot rewritten
    expert: torch.Tensor  # [M] long: logical expert the slot holds afterwards
    src_rank: torch.Tensor  # [M] long: a rank holding `expert` in the previous placement
    dst_rank: torch.Tensor  # [M] long: rank owning `slot`
    num_ranks: int
    num_nodes: int

    @property
    def num_moved(self) -> int:
        """Expert weights written (slots whose expert changes)."""
        return int(self.slot.numel())

    @property
    def num_remote(self) -> int:
        """Copies that cross ranks (the rest are copies within one rank's memory)."""
        return int((self.src_rank != self.dst_rank).sum())

    @property
    def num_cross_node(self) -> int:
        ranks_per_node = self.num_ranks // self.num_nodes
        return int((self.src_rank // ranks_per_node != self.dst_rank // ranks_per_node).sum())

    def per_layer(self, num_layers: int) -> torch.Tensor:
        """[L] long: expert weights moved in each layer."""
        return torch.bincount(self.layer, minlength=num_layers)

    def sends_per_rank(self) -> torch.Tensor:
        """[W] long: remote copies each rank serves as the source."""
        remote = self.src_rank != self.dst_rank
        return torch.bincount(self.src_rank[remote], minlength=self.num_ranks)

    def to_dict(self) -> dict:
        return {
            "num_moved": self.num_moved,
            "num_remote": self.num_remote,
            "num_cross_node": self.num_cross_node,
            "copies": [
                {"layer": l, "slot": s, "expert": e, "src_rank": a, "dst_rank": b}
                for l, s, e, a, b in zip(
                    self.layer.tolist(), self.slot.tolist(), self.expert.tolist(),
                    self.src_rank.tolist(), self.dst_rank.tolist(),
                )
            ],
        }


def plan_migration(previous: Placement, new: Placement) -> MigrationPlan:
    """Copies that turn `previous` into `new`.

    Each copy reads from the closest holder of the expert in `previous`: the
    destination rank itself, else a rank on the destination's node, else any
    rank; among equals, the one serving the fewest copies so far.
    """
    if previous.phy2log.shape != new.phy2log.shape:
        raise ValueError(
            f"plan_migration: previous.phy2log {tuple(previous.phy2log.shape)} and "
            f"new.phy2log {tuple(new.phy2log.shape)} differ in shape"
        )
    if previous.num_ranks != new.num_ranks or previous.num_experts != new.num_experts:
        raise ValueError(
            "plan_migration: previous and new placements differ in num_ranks or num_experts "
            f"({previous.num_ranks}, {previous.num_experts}) vs ({new.num_ranks}, {new.num_experts})"
        )
    num_ranks, num_nodes = new.num_ranks, new.num_nodes
    ranks_per_node = num_ranks // num_nodes
    slot_rank = new.slot_rank()  # [P]
    changed = (previous.phy2log != new.phy2log).nonzero()  # [M, 2]
    layers, slots = changed[:, 0], changed[:, 1]
    experts = new.phy2log[layers, slots]
    dst = slot_rank[slots]
    src = torch.empty_like(dst)
    served = torch.zeros(num_ranks, dtype=torch.long)
    for i, (layer, expert, dst_rank) in enumerate(zip(layers.tolist(), experts.tolist(), dst.tolist())):
        holders = previous.log2phy[layer, expert]
        holder_ranks = slot_rank[holders[holders >= 0]].tolist()
        if dst_rank in holder_ranks:
            src[i] = dst_rank
            continue
        same_node = [r for r in holder_ranks if r // ranks_per_node == dst_rank // ranks_per_node]
        pool = same_node or holder_ranks
        pick = min(pool, key=lambda r: (int(served[r]), r))
        served[pick] += 1
        src[i] = pick
    return MigrationPlan(layers, slots, experts, src, dst, num_ranks, num_nodes)
