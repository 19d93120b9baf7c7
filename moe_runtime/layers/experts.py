"""Experts held stacked: w13[E_local, 2I, H] (gate rows, then up rows), w2[E_local, H, I].

A dense MLP is the same thing with one expert: `DenseMLP` is `StackedExperts` holding one
expert that every token uses with weight 1, so there is one MLP code path.
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


class StackedExperts(nn.Module):
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


class DenseMLP(nn.Module):
    """SiLU-gated MLP as a single expert (weight 1, no router)."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels, dtype=torch.float32, device=None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(1, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
                                requires_grad=False)  # [1, 2I, H]
        self.w2 = nn.Parameter(torch.empty(1, hidden_size, intermediate_size, dtype=dtype, device=device),
                               requires_grad=False)  # [1, H, I]
        self._kernels = kernels

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        inter = self.intermediate_size
        for rows, name in ((slice(0, inter), "gate_proj"), (slice(inter, 2 * inter), "up_proj")):
            full = f"{prefix}{name}.weight"
            copy_checked(self.w13[0, rows], reader.read(full), full, reader.directory)
        copy_checked(self.w2[0], reader.read(f"{prefix}down_proj.weight"), f"{prefix}down_proj.weight", reader.directory)
        return {"w13", "w2"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        counts = torch.tensor([x.shape[0]], dtype=torch.long)
        return self._kernels.expert_mlp(x, counts, self.w13, self.w2)
