"""The narrow face through which live rebalancing moves one MoE layer's expert weights.

The rebalancer never touches parameters: it reads a slot's weights (to copy them to another
slot, here or on another rank), stages weights received for a slot, and, once every rank agreed
that the migration succeeded, commits them; otherwise it discards them and the placement in
force stays untouched. Staged weights are not in force before `commit`: a slot may still be the
source of another copy meanwhile.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ExpertStore(Protocol):
    def read_slot(self, local_slot: int) -> torch.Tensor:
        """[N] a packed copy of the expert weights in this rank's `local_slot` (all tensors, flat)."""

    def empty_slot(self) -> torch.Tensor:
        """[N] an uninitialised buffer, on the weights' device and dtype, to receive one slot into."""

    def stage(self, local_slot: int, expert: int, packed: torch.Tensor) -> None:
        """Hold `packed` (as `read_slot` returns it) as logical `expert`'s weights for `local_slot`."""

    def commit(self) -> None:
        """Write every staged slot in place; the store then holds the new experts."""

    def discard(self) -> None:
        """Drop every staged slot (a rolled-back migration)."""
