"""Placement: which logical expert each physical slot holds, per MoE layer.

Slots sit on ranks as `SlotGeometry` says; rank ``r`` lives on node
``r // ranks_per_node``. A placement is valid when every logical expert has at
least one slot and no rank holds two replicas of one expert (a second replica
on the same rank adds memory but takes no load off that rank).

A placement is a planning object and lives on the CPU; what one rank needs of it
on the step path, on the step's device, is its `ReplicaTable`s (replica_choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from moe_runtime.load_balancer.slot_geometry import SlotGeometry


@dataclass
class Placement:
    phy2log: torch.Tensor  # [L, P] long: logical expert held by each slot
    log2phy: torch.Tensor  # [L, E, R] long: slots of each logical expert, -1 padded
    logcnt: torch.Tensor  # [L, E] long: replica count
    num_ranks: int
    num_nodes: int = 1
    # Optional facts about how this placement was produced (balancedness, moves);
    # filled by `rebalance`, never used to decide anything.
    stats: Optional["RebalanceStats"] = field(default=None, compare=False)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def geometry(self) -> SlotGeometry:
        return SlotGeometry(self.num_slots, self.num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.geometry.slots_per_rank

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    def slot_rank(self) -> torch.Tensor:
        """[P] long: the rank each slot lives on."""
        return torch.from_numpy(self.geometry.slot_ranks())

    def is_identity(self, layer: int) -> bool:
        """Whether `layer` has no replicas and holds logical expert e on slot e."""
        return self.num_slots == self.num_experts and bool(
            torch.equal(self.phy2log[layer], torch.arange(self.num_slots, device=self.phy2log.device))
        )

    @classmethod
    def from_phy2log(
        cls,
        phy2log: torch.Tensor,
        num_experts: int,
        num_ranks: int,
        num_nodes: int = 1,
        check: bool = True,
    ) -> "Placement":
        """Build log2phy and logcnt from phy2log; `check` validates the result.

        Replicas in log2phy are listed in increasing slot order (so rank order).
        """
        phy2log = torch.as_tensor(phy2log, dtype=torch.long).cpu()
        if phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(phy2log.shape)}")
        num_layers, num_slots = phy2log.shape
        if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= num_experts):
            raise ValueError(
                f"phy2log holds expert ids outside [0, {num_experts}): "
                f"min {int(phy2log.min())}, max {int(phy2log.max())}"
            )
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.long)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        max_replicas = max(1, int(logcnt.max())) if logcnt.numel() else 1
        # Replica index of each slot = how many earlier slots hold the same expert.
        order = torch.argsort(phy2log * num_slots + torch.arange(num_slots), dim=1)  # [L, P]
        sorted_experts = phy2log.gather(1, order)
        first_of_expert = torch.cumsum(logcnt, dim=1) - logcnt  # [L, E]
        replica_index = torch.arange(num_slots) - first_of_expert.gather(1, sorted_experts)
        log2phy = torch.full((num_layers, num_experts * max_replicas), -1, dtype=torch.long)
        log2phy.scatter_(1, sorted_experts * max_replicas + replica_index, order)
        placement = cls(
            phy2log=phy2log,
            log2phy=log2phy.view(num_layers, num_experts, max_replicas),
            logcnt=logcnt,
            num_ranks=num_ranks,
            num_nodes=num_nodes,
        )
        if check:
            placement.validate()
        return placement

    def colocated_replicas(self) -> torch.Tensor:
        """[L] long: replicas that share a rank with another replica of their expert."""
        rank = self.slot_rank().expand_as(self.phy2log)
        per_rank = torch.zeros(self.num_layers, self.num_ranks * self.num_experts, dtype=torch.long)
        per_rank.scatter_add_(1, rank * self.num_experts + self.phy2log, torch.ones_like(self.phy2log))
        return (per_rank - 1).clamp(min=0).sum(1)

    def validate(self) -> None:
        """Raise ValueError naming the first broken invariant."""
        check_layout(self.num_experts, self.num_slots, self.num_ranks, self.num_nodes)
        num_layers, num_experts = self.logcnt.shape
        if self.phy2log.shape[0] != num_layers:
            raise ValueError(
                f"phy2log has {self.phy2log.shape[0]} layers but logcnt has {num_layers}"
            )
        if self.log2phy.shape[:2] != (num_layers, num_experts):
            raise ValueError(
                f"log2phy shape {tuple(self.log2phy.shape)} does not start with "
                f"logcnt shape {tuple(self.logcnt.shape)}"
            )
        missing = (self.logcnt < 1).nonzero()
        if len(missing):
            layer, expert = missing[0].tolist()
            raise ValueError(f"placement: layer {layer} expert {expert} has no slot (logcnt 0)")
        recount = torch.zeros_like(self.logcnt).scatter_add_(
            1, self.phy2log, torch.ones_like(self.phy2log)
        )
        if not torch.equal(recount, self.logcnt):
            raise ValueError("placement: logcnt disagrees with the replica count in phy2log")
        valid = self.log2phy >= 0
        if not torch.equal(valid.sum(-1), self.logcnt):
            raise ValueError("placement: log2phy's non-padding entries disagree with logcnt")
        experts = torch.arange(num_experts).view(1, -1, 1).expand_as(self.log2phy)
        held = self.phy2log.gather(1, self.log2phy.clamp(min=0).flatten(1)).view_as(self.log2phy)
        if not torch.equal(held[valid], experts[valid]):
            raise ValueError("placement: log2phy points at slots that phy2log gives to another expert")
        colocated = self.colocated_replicas()
        if int(colocated.sum()):
            layer = int(colocated.nonzero()[0])
            raise ValueError(
                f"placement: layer {layer} has {int(colocated[layer])} replicas sharing a rank "
                "with another replica of the same expert"
            )


@dataclass(frozen=True)
class RebalanceStats:
    balancedness_before: Optional[torch.Tensor]  # [L] previous placement on the new load
    balancedness_after: torch.Tensor  # [L]
    experts_moved: torch.Tensor  # [L] slots whose expert changed vs. previous


def check_layout(num_experts: int, num_slots: int, num_ranks: int, num_nodes: int) -> None:
    """Raise ValueError when no valid placement exists for these sizes."""
    for name, value in (
        ("num_experts", num_experts),
        ("num_slots", num_slots),
        ("num_ranks", num_ranks),
        ("num_nodes", num_nodes),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_slots % num_ranks:
        raise ValueError(
            f"num_slots ({num_slots}) must be divisible by num_ranks ({num_ranks}): "
            "every rank holds the same number of expert slots"
        )
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) must be divisible by num_nodes ({num_nodes})")
    if num_slots < num_experts:
        raise ValueError(
            f"num_slots ({num_slots}) < num_experts ({num_experts}): every expert needs a slot"
        )
    if num_slots > num_experts * num_ranks:
        raise ValueError(
            f"num_slots ({num_slots}) > num_experts * num_ranks ({num_experts * num_ranks}): "
            f"some expert would need more than {num_ranks} replicas, one per rank at most"
        )


def static_placement(
    num_layers: int, num_experts: int, num_slots: int, num_ranks: int, num_nodes: int = 1
) -> Placement:
    """Default placement before any load is seen.

    Expert e on slot e; redundant slot E + i holds expert i % E. Replicas of one
    expert are then E slots apart, and E >= slots_per_rank (see `check_layout`),
    so they always land on different ranks.
    """
    check_layout(num_experts, num_slots, num_ranks, num_nodes)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    phy2log = (torch.arange(num_slots) % num_experts).repeat(num_layers, 1)  # [L, P]
    return Placement.from_phy2log(phy2log, num_experts, num_ranks, num_nodes)
