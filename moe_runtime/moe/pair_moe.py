"""The MoE core of a captured step on one rank: every (token, expert) pair one GEMV, no dispatch.

On one rank every slot is a local expert, so there is nothing to move; but the local dispatcher's
grouping by expert has data-dependent sizes (rows per expert), which a captured graph cannot hold.
The family's pair kernel (`KernelSet.pair_expert_mlp`, moe_runtime/kernels/pair_experts.py) takes
the router's layout as it is, [T, K] slots and weights, and weighs and sums each token's K outputs
itself: inductor fuses it into loops streaming each chosen expert's weights (the cpu family's
compiled kernel is one opaque operator). It is the captured phase's choice of `MoECore` on one
rank (`MoEExecutor`); eager steps group by expert (`ModularMoE` with the local dispatcher), where
gathering the pairs' weights would be materialized.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.modular_moe import Alongside


class PairMoE:
    def __init__(self, pair_expert_mlp: Callable):
        self.pair_expert_mlp = pair_expert_mlp   # (x [T, H], slot_ids [T, K], weights [T, K], w13, w2, *, epilogue)

    def __call__(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                 alongside: Alongside | None = None, timed: bool = True) -> torch.Tensor:  # [T, H] -> [T, H]
        """One rank's slots are its local experts: slot_ids index `experts` directly. Nothing to time, and the
        caller's `alongside` work runs after (`Alongside.added_to`)."""
        return self.pair_expert_mlp(x, slot_ids, weights, experts.w13, experts.w2, **experts.epilogue())
