"""What a dispatcher needs to know of where physical expert slots live, and validation of its inputs.

The slot -> (rank, local expert) rule is not written here: it belongs to the placement's owner
(`load_balancer.SlotGeometry`), which the MoE executor hands to every dispatcher it builds. A
dispatcher only asks the questions of `SlotLayout`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SlotLayout(Protocol):
    """Where each physical slot lives. Slot ids < 0 are masked: their rank and local index are -1.

    Every rank holds `slots_per_rank` slots, local indices 0 .. slots_per_rank - 1 (the rows of its
    stacked expert weights, and of `tokens_per_local_expert`).
    """

    @property
    def num_slots(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    @property
    def slots_per_rank(self) -> int: ...

    def rank_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Owning rank per slot id (any shape), -1 where masked."""

    def local_index_of(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Local expert index on the owning rank per slot id (any shape), -1 where masked."""


def check_dispatch_inputs(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                          num_slots: int, hidden_size: int | None = None, check_values: bool = True) -> None:
    """Raise ValueError naming the offending tensor when the inputs break the contract.

    `check_values=False` checks shapes and dtypes only (host metadata): the range of the slot ids is a value on
    the device, and reading it would stall a GPU decode step. DeepEP's low-latency path skips it: its slot
    ids come from the replica tables (moe_runtime/load_balancer/replica_choice.py), in range by construction, and the
    backends that read the device anyway (their split sizes) keep the check."""
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
    if check_values and slot_ids.numel() and int(slot_ids.max()) >= num_slots:
        raise ValueError(f"dispatch: slot_ids holds slot {int(slot_ids.max())}, but there are "
                         f"only num_slots={num_slots} physical slots")
