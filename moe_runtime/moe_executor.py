"""Turns logical top-k choices into expert outputs. The single-rank executor runs every expert
locally; the expert-parallel one (placement -> dispatch -> experts -> combine) has the same face."""
from __future__ import annotations

import torch


class LocalMoEExecutor:
    """One rank holds every expert: fused permute -> grouped expert MLP -> weighted unpermute."""

    def __init__(self, kernels):
        self._kernels = kernels

    def local_expert_ids(self, layer_index: int, num_experts: int) -> list[int]:
        return list(range(num_experts))

    def begin_step(self, phase: str) -> None:
        """No collectives here, so nothing to agree on."""

    def end_step(self) -> None:
        pass

    def needs_phase_agreement(self) -> bool:
        return False

    def run(self, layer_index: int, x: torch.Tensor, topk, experts) -> torch.Tensor:  # [T, H] -> [T, H]
        return self._kernels.fused_moe(x, experts.w13, experts.w2, topk.weights, topk.ids)
