"""Per-step expert load: tokens per logical expert, physical slot and rank.

Hot path cost per MoE layer and step: one `index_add_` into a preallocated
tensor for logical experts, and one more when physical slots are recorded.
No host sync, no Python loop over experts. The step in progress is counted
into fixed buffers (same addresses every step, so `record` can sit inside a
captured CUDA graph); `end_step()` copies them into a ring of `window` steps,
adds them to the running totals and clears them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_runtime.load_balancer.balancedness import max_over_mean, mean_over_max
from moe_runtime.load_balancer.placement import Placement, static_placement
from moe_runtime.load_balancer.slot_geometry import SlotGeometry


@dataclass
class ExpertLoadSnapshot:
    counts: torch.Tensor  # [L, E] tokens per logical expert over the window
    totals: torch.Tensor  # [L, E] tokens per logical expert since the start
    rank_load: torch.Tensor  # [L, W] tokens per rank over the window
    balancedness: torch.Tensor  # [L] mean / max of rank_load
    max_over_mean: torch.Tensor  # [L] max / mean of rank_load
    window: int  # steps the window covers (fewer at the start)
    steps: int  # completed steps since the start
    placement: torch.Tensor  # [L, P] phy2log in force

    def to_dict(self) -> dict:
        return {
            "counts": self.counts.tolist(),
            "totals": self.totals.tolist(),
            "rank_load": self.rank_load.tolist(),
            "balancedness": self.balancedness.tolist(),
            "max_over_mean": self.max_over_mean.tolist(),
            "window": self.window,
            "steps": self.steps,
            "placement": self.placement.tolist(),
        }

    @classmethod
    def from_dict(cls, tables: dict) -> "ExpertLoadSnapshot":
        """The inverse of `to_dict` (snapshots cross process boundaries as lists, never as tensors)."""
        return cls(
            counts=torch.tensor(tables["counts"], dtype=torch.long),
            totals=torch.tensor(tables["totals"], dtype=torch.long),
            rank_load=torch.tensor(tables["rank_load"], dtype=torch.float64),
            balancedness=torch.tensor(tables["balancedness"], dtype=torch.float64),
            max_over_mean=torch.tensor(tables["max_over_mean"], dtype=torch.float64),
            window=int(tables["window"]),
            steps=int(tables["steps"]),
            placement=torch.tensor(tables["placement"], dtype=torch.long),
        )


class ExpertLoadRecorder:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        num_ranks: int,
        window: int = 128,
        device: torch.device | str = "cpu",
        placement: Optional[Placement] = None,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.num_slots, self.num_ranks = num_slots, num_ranks
        self.geometry = SlotGeometry(num_slots, num_ranks)
        self.window = window
        self.device = torch.device(device)
        self.placement = placement or static_placement(num_layers, num_experts, num_slots, num_ranks)
        self._expert_step = torch.zeros(num_layers, num_experts, dtype=torch.long, device=self.device)
        self._slot_step = torch.zeros(num_layers, num_slots, dtype=torch.long, device=self.device)
        self._expert_ring = torch.zeros(window, num_layers, num_experts, dtype=torch.long, device=self.device)
        self._slot_ring = torch.zeros(window, num_layers, num_slots, dtype=torch.long, device=self.device)
        self._expert_totals = torch.zeros(num_layers, num_experts, dtype=torch.long, device=self.device)
        self._one = torch.ones(1, dtype=torch.long, device=self.device)
        self._slots_seen = False
        self._row = 0  # ring row the next finished step goes to
        self.steps = 0

    def set_placement(self, placement: Placement) -> None:
        """The placement now in force (used for per-rank load when slots are not recorded)."""
        if tuple(placement.phy2log.shape) != (self.num_layers, self.num_slots):
            raise ValueError(
                f"placement.phy2log {tuple(placement.phy2log.shape)} does not match the recorder's "
                f"({self.num_layers}, {self.num_slots})"
            )
        self.placement = placement

    def record(self, layer: int, logical_ids: torch.Tensor, slot_ids: Optional[torch.Tensor] = None) -> None:
        """Count one MoE layer's routing of this step: logical_ids / slot_ids [T, K]."""
        ids = logical_ids.reshape(-1)
        self._expert_step[layer].index_add_(0, ids, self._one.expand(ids.numel()))
        if slot_ids is not None:
            slots = slot_ids.reshape(-1)
            self._slot_step[layer].index_add_(0, slots, self._one.expand(slots.numel()))
            self._slots_seen = True

    def end_step(self) -> None:
        """Close the step being recorded (call once per forward step, after the last layer)."""
        self._expert_ring[self._row].copy_(self._expert_step)
        self._slot_ring[self._row].copy_(self._slot_step)
        self._expert_totals += self._expert_step
        self._expert_step.zero_()
        self._slot_step.zero_()
        self._row = (self._row + 1) % self.window
        self.steps += 1

    def window_steps(self) -> torch.Tensor:
        """[S, L, E] per-step logical counts of the finished steps in the window, oldest first."""
        count = min(self.steps, self.window)
        rows = [(self._row - count + i) % self.window for i in range(count)]
        return self._expert_ring[rows].cpu()

    def snapshot(self, group=None) -> ExpertLoadSnapshot:
        """Load over the window; with a torch.distributed `group`, summed over its ranks."""
        in_window = self._window_mask()
        counts = self._expert_ring[in_window].sum(0)  # [L, E]
        slot_counts = self._slot_ring[in_window].sum(0)  # [L, P]
        totals = self._expert_totals.clone()
        if group is not None:
            for tensor in (counts, slot_counts, totals):
                dist.all_reduce(tensor, group=group)
        counts, slot_counts, totals = counts.cpu(), slot_counts.cpu(), totals.cpu()
        if self._slots_seen:
            per_rank = self.geometry.sum_per_rank(slot_counts).double()  # [L, W]
        else:  # the split the runtime does: a replicated expert's tokens shared evenly
            per_replica = counts.double() / self.placement.logcnt.clamp(min=1)
            per_rank = self.geometry.sum_per_rank(per_replica.gather(1, self.placement.phy2log))  # [L, W]
        return ExpertLoadSnapshot(
            counts=counts,
            totals=totals,
            rank_load=per_rank,
            balancedness=mean_over_max(per_rank),
            max_over_mean=max_over_mean(per_rank),
            window=int(in_window.sum()),
            steps=self.steps,
            placement=self.placement.phy2log.clone(),
        )

    def _window_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.window, dtype=torch.bool, device="cpu")
        mask[(self._row - 1 - torch.arange(min(self.steps, self.window), device="cpu")) % self.window] = True
        return mask.to(self.device)
