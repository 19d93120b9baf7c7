"""One dispatcher x one expert kernel: the placement-free core of an MoE layer on one rank.

    dispatch (prepare: tokens -> the ranks holding their slots, grouped by local expert)
      -> expert kernel (this rank's experts, unweighted)
      -> combine (finalize: weighted sum back on each token's own rank)

Any dispatcher (local, all_to_all, allgather, deepep; `dispatch.Dispatcher`) pairs with any
expert kernel (torch, Triton, reference; `ExpertKernel`) that takes its layout, so there is one
code path for one rank and for many: one rank is the local dispatcher.

Calling it (`__call__`) is the forward of eager and captured steps: dispatch, experts, combine,
each blocking. `stages` is the same work for two-batch overlap only (moe_runtime/moe/stages.py):
dispatch and combine are started, it yields while they are in flight (the other micro-batch
computes there) and waits for them when resumed. A dispatcher that cannot overlap
(`supports_async()` False) has finished each transfer when it returns it, so the same stages run
synchronously.

`MoECore` is what the executor calls per step; a captured step on one rank calls the pair kernel
instead (moe_runtime/moe/pair_moe.py), which has no dispatch to split.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from moe_runtime.dispatch.base import Dispatcher, DispatchOutput
from moe_runtime.dispatch.pending import Pending
from moe_runtime.moe.comm_timeline import CommTimeline, TransferTimes
from moe_runtime.moe.expert_kernel import ExpertKernel
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.host_experts import StartedExpertKernel
from moe_runtime.moe.stages import Staged, YieldPoint


@dataclass
class Alongside:
    """The MoE block's work that does not wait for its routed experts (its shared experts): run while they compute
    on the host (--cpu-experts: `ModularMoE` calls `run` there), else once they are done (`added_to`). Its output
    [T, H] (None: no such work) is added to the routed experts'."""

    work: Callable[[], torch.Tensor | None] | None = None
    out: torch.Tensor | None = None
    done: bool = False

    def run(self) -> None:
        if not self.done:
            self.out, self.done = (None if self.work is None else self.work()), True

    def added_to(self, routed: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, H]
        self.run()
        return routed if self.out is None else routed + self.out


class MoECore(Protocol):
    """x [T, H] this rank's rows, their physical slots and routing weights [T, K], this rank's experts -> the
    weighted routed output [T, H]. `timed`: whether to read the wall clock (not inside a captured step)."""

    def __call__(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                 alongside: Alongside | None = None, timed: bool = True) -> torch.Tensor: ...


class ModularMoE:
    def __init__(self, dispatcher: Dispatcher, kernel: ExpertKernel):
        if dispatcher.layout() != kernel.layout:
            raise ValueError(f"the dispatcher hands over the {dispatcher.layout()!r} layout, the expert kernel "
                             f"takes {kernel.layout!r}")
        self.dispatcher = dispatcher
        self.kernel = kernel
        self._on_host = isinstance(kernel, StartedExpertKernel)   # asked once: not a check to trace every step
        self.comm_seconds = 0.0  # cumulative wall time this rank spent in dispatch + combine (starts and waits)
        self.timeline: CommTimeline | None = None  # per-transfer timestamps, when a benchmark asks for them

    def __call__(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                 alongside: Alongside | None = None, timed: bool = True) -> torch.Tensor:
        """Dispatch, experts, combine, each blocking: x [T, H], slot_ids/weights [T, K] -> [T, H]."""
        started = time.perf_counter() if timed else None
        out = self.dispatcher.dispatch(x, slot_ids, weights)
        self._blocked("dispatch", started)
        expert_out = self._experts(out, experts, alongside)
        started = time.perf_counter() if timed else None
        y = self.dispatcher.combine(expert_out, out.handle)                         # [T, H]
        self._blocked("combine", started)
        return y

    def stages(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
               alongside: Alongside | None = None) -> Staged[torch.Tensor]:  # x [T, H], slot_ids/weights [T, K]
        """Two-batch overlap's form: start dispatch, yield; wait, run the experts, start combine, yield; wait: the
        weighted outputs [T, H]."""
        started = time.perf_counter()
        dispatching = self.dispatcher.dispatch_start(x, slot_ids, weights)
        times = self._started("dispatch", started, dispatching)
        yield YieldPoint.DISPATCH
        out = self._wait(dispatching, times)
        expert_out = self._experts(out, experts, alongside)
        started = time.perf_counter()
        combining = self.dispatcher.combine_start(expert_out, out.handle)
        times = self._started("combine", started, combining)
        yield YieldPoint.COMBINE
        return self._wait(combining, times)                                         # [T, H]

    def _experts(self, out: DispatchOutput, experts: ExpertWeights,
                 alongside: Alongside | None) -> torch.Tensor:   # recv_x -> unweighted, the same layout
        """This rank's experts on the dispatched rows. Experts that run on the host (`StartedExpertKernel`) are
        started, the caller's `alongside` work runs meanwhile on this thread, then they are waited for."""
        if not self._on_host:
            return self.kernel(out.recv_x, out.tokens_per_local_expert, experts)
        running = self.kernel.start(out.recv_x, out.tokens_per_local_expert, experts)
        if alongside is not None:
            alongside.run()
        return running.wait()

    def _blocked(self, kind: str, started: float | None) -> None:
        """A blocking transfer called at `started` has just returned (None: untimed, inside a captured step)."""
        if started is None:
            return
        returned = time.perf_counter()
        self.comm_seconds += returned - started
        if self.timeline is not None:
            self.timeline.blocking(kind, started, returned)

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
