"""Experts held stacked: w13[E_local, 2I, H] (gate rows, then up rows), w2[E_local, H, I].

Row i of both tensors is this rank's local slot i; `expert_ids[i]` is the logical expert it holds
(the placement in force says the same). The stack is also the layer's `ExpertStore`: live
rebalancing reads, stages and commits slots through it and never touches the parameters itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.checkpoint import CheckpointReader, read_rows
from moe_runtime.weight_loading import copy_checked


@dataclass(frozen=True)
class ExpertNaming:
    """Checkpoint names of one expert's three projections (relative to `<prefix><expert>.`)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_NAMING = ExpertNaming(gate="w1", up="w3", down="w2")


@dataclass(frozen=True)
class StagedSlot:
    """Weights received for a slot, not in force before `commit`."""

    local_slot: int
    expert: int
    packed: torch.Tensor  # [2I*H + H*I] as `read_slot` packs them


class ExpertWeights(nn.Module):
    def __init__(self, expert_ids: list[int], hidden_size: int, intermediate_size: int,
                 naming: ExpertNaming = ExpertNaming(), dtype=torch.float32, device=None):
        super().__init__()
        self.expert_ids = list(expert_ids)  # logical expert held by each local slot
        self.naming = naming
        self.intermediate_size = intermediate_size
        num_local = len(self.expert_ids)
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
                                requires_grad=False)  # [E_local, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype, device=device),
                               requires_grad=False)  # [E_local, H, I]
        self._staged: list[StagedSlot] = []

    @property
    def num_local_experts(self) -> int:
        return len(self.expert_ids)

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.w13, self.w2))

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        """Per-expert tensors (`<prefix><e>.gate_proj.weight`, the HF layout) or fused 3D ones."""
        fused_gate_up = f"{prefix}gate_up_proj"
        inter = self.intermediate_size
        for local, expert in enumerate(self.expert_ids):
            if reader.has(fused_gate_up):
                gate_up = read_rows(reader, fused_gate_up, expert, expert + 1)[0]
                down = read_rows(reader, f"{prefix}down_proj", expert, expert + 1)[0]
                copy_checked(self.w13[local], gate_up, fused_gate_up, reader.directory)
                copy_checked(self.w2[local], down, f"{prefix}down_proj", reader.directory)
                continue
            base = f"{prefix}{expert}."
            copy_checked(self.w13[local, :inter], reader.read(f"{base}{self.naming.gate}.weight"),
                         f"{base}{self.naming.gate}.weight", reader.directory)
            copy_checked(self.w13[local, inter:], reader.read(f"{base}{self.naming.up}.weight"),
                         f"{base}{self.naming.up}.weight", reader.directory)
            copy_checked(self.w2[local], reader.read(f"{base}{self.naming.down}.weight"),
                         f"{base}{self.naming.down}.weight", reader.directory)
        return {"w13", "w2"}

    # ---- load_balancer.ExpertStore -----------------------------------------------------------------
    def read_slot(self, local_slot: int) -> torch.Tensor:  # -> [2I*H + H*I], a copy
        return torch.cat([self.w13[local_slot].reshape(-1), self.w2[local_slot].reshape(-1)])

    @property
    def slot_numel(self) -> int:
        """Elements of one slot's packed weights (2I*H + H*I)."""
        return self.w13[0].numel() + self.w2[0].numel()

    def empty_slot(self) -> torch.Tensor:  # -> [2I*H + H*I]
        return torch.empty(self.slot_numel, dtype=self.w13.dtype, device=self.w13.device)

    def stage(self, local_slot: int, expert: int, packed: torch.Tensor) -> None:
        if not 0 <= local_slot < self.num_local_experts:
            raise IndexError(f"local slot {local_slot} outside this rank's {self.num_local_experts} slots")
        if tuple(packed.shape) != (self.slot_numel,):
            raise ValueError(f"staged weights for slot {local_slot} have shape {tuple(packed.shape)}, "
                             f"expected ({self.slot_numel},)")
        self._staged.append(StagedSlot(local_slot, expert, packed))

    def commit(self) -> None:
        rows13 = self.w13[0].numel()
        with torch.no_grad():
            for staged in self._staged:
                self.w13[staged.local_slot].copy_(staged.packed[:rows13].view_as(self.w13[0]))
                self.w2[staged.local_slot].copy_(staged.packed[rows13:].view_as(self.w2[0]))
                self.expert_ids[staged.local_slot] = staged.expert
        self._staged.clear()

    def discard(self) -> None:
        self._staged.clear()
