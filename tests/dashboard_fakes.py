"""A fake engine for dashboard tests: `FakeEngine`'s token stream plus real expert-load recording.

Each generated token is routed (top-2) to logical experts chosen from its token id, with a skew
toward the low expert ids, and counted by a real `ExpertLoadRecorder`; `rebalance_now` plans a new
placement with the real `load_balancer.rebalance` and reports it as a `RebalanceEvent`.
"""
from __future__ import annotations

import time

import torch
from server_harness import FakeEngine

from moe_runtime.load_balancer import ExpertLoadRecorder, RebalanceEvent, plan_migration, rebalance, static_placement


class RoutingFakeEngine(FakeEngine):
    def __init__(self, num_layers: int = 3, num_experts: int = 8, num_ranks: int = 2, num_redundant: int = 2,
                 window: int = 64, **kwargs):
        super().__init__(**kwargs)
        num_slots = num_experts + num_redundant
        self.recorder = ExpertLoadRecorder(num_layers, num_experts, num_slots, num_ranks, window=window,
                                           placement=static_placement(num_layers, num_experts, num_slots, num_ranks))
        self.snapshot = self.recorder.snapshot()
        self.events: list[RebalanceEvent] = []

    def step(self):
        outputs = super().step()
        tokens = torch.tensor([t for o in outputs for t in o.new_token_ids], dtype=torch.long)  # [T]
        if tokens.numel():
            num_layers, num_experts = self.recorder.num_layers, self.recorder.num_experts
            for layer in range(num_layers):
                first = (tokens * (layer + 1)) % 3                 # experts 0..2 are hot
                second = (tokens + layer) % num_experts
                second = torch.where(second == first, (second + 1) % num_experts, second)
                self.recorder.record(layer, torch.stack([first, second], dim=1))  # [T, 2]
        self.recorder.end_step()
        return outputs

    def load_snapshot(self):
        return self.recorder.snapshot()

    def rebalance_event(self) -> RebalanceEvent:
        started = time.time()
        before = self.recorder.placement
        snapshot = self.recorder.snapshot()
        placement = rebalance(snapshot.counts, before.num_slots, before.num_ranks, previous=before,
                              min_gain_per_move=0.0)
        self.recorder.set_placement(placement)
        event = RebalanceEvent(
            index=len(self.events), trigger="manual", started_at=started, duration_s=time.time() - started,
            experts_moved=plan_migration(before, placement).num_moved,
            balancedness_before=float(placement.stats.balancedness_before.mean()),
            balancedness_after=float(placement.stats.balancedness_after.mean()))
        self.events.append(event)
        return event
