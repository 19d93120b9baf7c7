"""One dispatcher x one expert kernel: the placement-free core of an MoE layer on one rank.

    dispatch (prepare: tokens -> the ranks holding their slots, grouped by local expert)
      -> expert kernel (this rank's experts, unweighted)
      -> combine (finalize: weighted sum back on each token's own rank)

Any dispatcher (local, all_to_all, allgather, deepep; `dispatch.Dispatcher`) pairs with any
expert kernel (torch, Triton, reference; `ExpertKernel`) that takes its layout, so there is one
code path for one rank and for many: one rank is the local dispatcher.
"""
from __future__ import annotations

import time

import torch

from dispatch.base import Dispatcher
from moe_runtime.moe.expert_kernel import ExpertKernel
from moe_runtime.moe.expert_weights import ExpertWeights


class ModularMoE:
    def __init__(self, dispatcher: Dispatcher, kernel: ExpertKernel):
        if dispatcher.layout() != kernel.layout:
            raise ValueError(f"the dispatcher hands over the {dispatcher.layout()!r} layout, the expert kernel "
                             f"takes {kernel.layout!r}")
        self.dispatcher = dispatcher
        self.kernel = kernel
        self.comm_seconds = 0.0  # cumulative wall time in dispatch + combine

    def __call__(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor:  # x [T, H], slot_ids/weights [T, K] -> [T, H]
        started = time.perf_counter()
        out = self.dispatcher.dispatch(x, slot_ids, weights)
        dispatched = time.perf_counter()
        expert_out = self.kernel(out.recv_x, out.tokens_per_local_expert, experts)
        computed = time.perf_counter()
        y = self.dispatcher.combine(expert_out, out.handle)
        self.comm_seconds += (dispatched - started) + (time.perf_counter() - computed)
        return y
