"""Where physical expert slots live: the one statement of the slot -> rank rule.

Slot ``s`` lives on rank ``s // slots_per_rank`` as that rank's local slot ``s % slots_per_rank``;
every rank holds the same number of slots, in slot order. The planner, the placement, replica
choice, weight migration and the dispatchers (which receive this object through the executor)
all ask here instead of restating the arithmetic. A slot id below 0 means "masked, no expert":
it has no rank and no local slot (-1 for both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SlotGeometry:
    num_slots: int
    num_ranks: int

    def __post_init__(self):
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_slots < self.num_ranks or self.num_slots % self.num_ranks:
            raise ValueError(f"num_slots ({self.num_slots}) must be a positive multiple of "
                             f"num_ranks ({self.num_ranks}): every rank holds the same number of slots")

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    # ---- one slot (planning, migration) -----------------------------------------------------------
    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def local_index(self, slot: int) -> int:
        """The slot's index among its rank's slots (the row of that rank's stacked expert weights)."""
        return slot % self.slots_per_rank

    def rank_slots(self, rank: int) -> range:
        """The slots `rank` holds, in local-index order."""
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    # ---- every slot at once (planning arrays are numpy, step-path tensors are torch) --------------
    def slot_ranks(self) -> np.ndarray:
        """[P] int64: the rank of every slot."""
        return np.arange(self.num_slots, dtype=np.int64) // self.slots_per_rank

    def slot_of(self, rank, local_index):
        """Slot id(s) of (rank, local index) pairs: ints, numpy arrays or tensors alike."""
        return rank * self.slots_per_rank + local_index

    def sum_per_rank(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[..., P] -> [..., W]: a per-slot quantity summed over each rank's slots."""
        return per_slot.reshape(*per_slot.shape[:-1], self.num_ranks, self.slots_per_rank).sum(-1)

    def rank_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Owning rank per slot id (any shape); -1 where the slot is masked (< 0)."""
        return torch.where(slot_ids >= 0, slot_ids // self.slots_per_rank, -1)

    def local_index_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Local slot index per slot id (any shape); -1 where the slot is masked (< 0)."""
        return torch.where(slot_ids >= 0, slot_ids % self.slots_per_rank, -1)
