"""Experts held stacked: w13[E_local, 2I, H] (gate rows, then up rows), w2[E_local, H, I].

A dense MLP is the same thing with one expert: `DenseMLP` is `StackedExperts` holding one
expert that every token uses with weight 1, so there is one MLP code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_runtime.checkpoint import CheckpointReader, read_rows, read_slice
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
    """SiLU-gated MLP as a single expert (weight 1, no router).

    Under tensor parallelism the one expert is split along its intermediate dim, exactly as an
    expert is: rank r holds gate/up rows and down columns [r * I/tp, (r + 1) * I/tp), and the
    ranks' partial outputs are summed with one all-reduce.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, kernels, dtype=torch.float32, device=None,
                 tp_size: int = 1, tp_rank: int = 0, tp_group=None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.shard = intermediate_size // tp_size
        self.shard_start = tp_rank * self.shard
        self.tp_size, self.tp_group = tp_size, tp_group
        self.w13 = nn.Parameter(torch.empty(1, 2 * self.shard, hidden_size, dtype=dtype, device=device),
                                requires_grad=False)  # [1, 2I/tp, H]
        self.w2 = nn.Parameter(torch.empty(1, hidden_size, self.shard, dtype=dtype, device=device),
                               requires_grad=False)  # [1, H, I/tp]
        self._kernels = kernels

    def load_weights(self, reader: CheckpointReader, prefix: str) -> set[str]:
        start, stop, shard = self.shard_start, self.shard_start + self.shard, self.shard
        for rows, name in ((slice(0, shard), "gate_proj"), (slice(shard, 2 * shard), "up_proj")):
            full = f"{prefix}{name}.weight"
            tensor = reader.read(full) if self.tp_size == 1 else read_slice(reader, full, 0, start, stop)
            copy_checked(self.w13[0, rows], tensor, full, reader.directory)
        full = f"{prefix}down_proj.weight"
        tensor = reader.read(full) if self.tp_size == 1 else read_slice(reader, full, 1, start, stop)
        copy_checked(self.w2[0], tensor, full, reader.directory)
        return {"w13", "w2"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        counts = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)  # [1]: on the input's device, where
        # the expert kernel runs (a Triton kernel cannot read a CPU tensor)
        out = self._kernels.expert_mlp(x, counts, self.w13, self.w2)
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.tp_group)
        return out
