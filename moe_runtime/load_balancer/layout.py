"""Sizes and node structure one layer's placement must respect."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_runtime.load_balancer.slot_geometry import SlotGeometry


@dataclass(frozen=True)
class Layout:
    """Sizes and the node structure one layer's placement must respect."""

    num_experts: int
    num_slots: int
    num_ranks: int
    num_nodes: int
    num_groups: Optional[int]  # None: global placement (replicas may cross nodes)

    @property
    def hierarchical(self) -> bool:
        return self.num_groups is not None

    @property
    def geometry(self) -> SlotGeometry:
        return SlotGeometry(self.num_slots, self.num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.geometry.slots_per_rank

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def max_replicas(self) -> int:
        return self.ranks_per_node if self.hierarchical else self.num_ranks

    @property
    def group_size(self) -> int:
        return self.num_experts // (self.num_groups or 1)
