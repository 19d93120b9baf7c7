"""One dispatcher x one expert kernel: the placement-free core of an MoE layer on one rank.

    dispatch (prepare: tokens -> the ranks holding their slots, grouped by local expert)
      -> expert kernel (this rank's experts, unweighted)
      -> combine (finalize: weighted sum back on each token's own rank)

Any dispatcher (local, all_to_all, allgather, deepep; `dispatch.Dispatcher`) pairs with any
expert kernel (torch, Triton, reference; `ExpertKernel`) that takes its layout, so there is one
code path for one rank and for many: one rank is the local dispatcher.

The path is staged (moe_runtime/moe/stages.py): dispatch and combine are started, the layer yields
while they are in flight, and waits for them when it is resumed. Called plainly, nothing runs in
between; under two-batch overlap the other micro-batch computes there. A dispatcher that cannot
overlap (`supports_async()` False) has finished each transfer when it returns it, so the same
stages run synchronously.
"""
from __future__ import annotations

import time

import torch

from moe_runtime.dispatch.base import Dispatcher
from moe_runtime.dispatch.pending import Pending
from moe_runtime.moe.comm_timeline import CommTimeline, TransferTimes
from moe_runtime.moe.expert_kernel import ExpertKernel
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.host_experts import StartedExpertKernel
from moe_runtime.moe.stages import Staged, YieldPoint, run_to_end


class ModularMoE:
    def __init__(self, dispatcher: Dispatcher, kernel: ExpertKernel):
        if dispatcher.layout() != kernel.layout:
            raise ValueError(f"the dispatcher hands over the {dispatcher.layout()!r} layout, the expert kernel "
                             f"takes {kernel.layout!r}")
        self.dispatcher = dispatcher
        self.kernel = kernel
        self.comm_seconds = 0.0  # cumulative wall time this rank spent in dispatch + combine (starts and waits)
        self.timeline: CommTimeline | None = None  # per-transfer timestamps, when a benchmark asks for them

    def __call__(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor:  # x [T, H], slot_ids/weights [T, K] -> [T, H]
        return run_to_end(self.stages(x, slot_ids, weights, experts))

    def stages(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
               experts: ExpertWeights) -> Staged[torch.Tensor]:  # x [T, H], slot_ids/weights [T, K] -> [T, H]
        """Start dispatch, yield; wait, run the experts, start combine, yield; wait: the weighted outputs. Experts
        that run on the host (`StartedExpertKernel`) are started, then yielded on (HOST_EXPERTS), then waited."""
        started = time.perf_counter()
        dispatching = self.dispatcher.dispatch_start(x, slot_ids, weights)
        times = self._started("dispatch", started, dispatching)
        yield YieldPoint.DISPATCH
        out = self._wait(dispatching, times)
        if isinstance(self.kernel, StartedExpertKernel):   # --cpu-experts: the experts run on the host meanwhile
            running = self.kernel.start(out.recv_x, out.tokens_per_local_expert, experts)
            yield YieldPoint.HOST_EXPERTS
            expert_out = running.wait()
        else:
            expert_out = self.kernel(out.recv_x, out.tokens_per_local_expert, experts)
        started = time.perf_counter()
        combining = self.dispatcher.combine_start(expert_out, out.handle)
        times = self._started("combine", started, combining)
        yield YieldPoint.COMBINE
        return self._wait(combining, times)                                         # [T, H]

    def _started(self, kind: str, started: float, pending: Pending) -> TransferTimes | None:
        if self.timeline is not None:
            times = self.timeline.started(kind, started, pending)
            self.comm_seconds += times.start_returned - started
            return times
        self.comm_seconds += time.perf_counter() - started
        return None

    def _wait(self, pending: Pending, times: TransferTimes | None):
        called = time.perf_counter()
        value = pending.wait()
        returned = time.perf_counter()
        self.comm_seconds += returned - called
        if times is not None:
            times.wait_called, times.wait_returned = called, returned
        return value
