"""Where physical expert slots live, and validation of dispatch inputs against that placement."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SlotPlacement:
    """Slot s lives on rank s // slots_per_rank as local expert s % slots_per_rank."""

    num_slots: int
    world_size: int

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.num_slots < self.world_size or self.num_slots % self.world_size:
            raise ValueError(f"num_slots ({self.num_slots}) must be a positive multiple of "
                             f"world_size ({self.world_size})")

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.world_size

    def rank_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Owning rank per slot; -1 where the slot is masked (< 0)."""
        return torch.where(slot_ids >= 0, slot_ids // self.slots_per_rank, -1)

    def local_expert_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Local expert index per slot; -1 where the slot is masked (< 0)."""
        return torch.where(slot_ids >= 0, slot_ids % self.slots_per_rank, -1)


def check_dispatch_inputs(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                          num_slots: int, hidden_size: int | None = None) -> None:
    """Raise ValueError naming the offending tensor when the inputs break the contract."""
    if x.dim() != 2:
        raise ValueError(f"dispatch: x must be [T, H], got shape {tuple(x.shape)}")
    if hidden_size is not None and x.shape[1] != hidden_size:
        raise ValueError(f"dispatch: x has hidden size {x.shape[1]}, the dispatcher was built "
                         f"for hidden_size={hidden_size}")
    if slot_ids.dim() != 2 or slot_ids.shape[0] != x.shape[0]:
        raise ValueError(f"dispatch: slot_ids must be [T, K] with T={x.shape[0]} (rows of x), "
                         f"got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype != torch.int64:
        raise ValueError(f"dispatch: slot_ids must be int64, got {slot_ids.dtype}")
    if weights.shape != slot_ids.shape:
        raise ValueError(f"dispatch: weights must have the shape of slot_ids "
                         f"{tuple(slot_ids.shape)}, got {tuple(weights.shape)}")
    if not weights.is_floating_point():
        raise ValueError(f"dispatch: weights must be floating point, got {weights.dtype}")
    if slot_ids.numel() and int(slot_ids.max()) >= num_slots:
        raise ValueError(f"dispatch: slot_ids holds slot {int(slot_ids.max())}, but there are "
                         f"only num_slots={num_slots} physical slots")
