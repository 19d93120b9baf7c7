"""DeepEP's low-latency dispatch and combine as torch operators, so a captured decode step traces them whole.

`torch.compile` cannot trace into `deep_ep.Buffer` (a C++ extension: a graph break, refused by a
`fullgraph=True` capture), but the low-latency calls are what CUDA graphs can replay: fixed-size outputs
([E_local, M, H] rows and [E_local] counts for any routing), counts kept on the device. Declared as
operators with those shapes (`register_fake`), the compiler places them in the graph as opaque calls, and
a CUDA graph records the kernels they launch (DeepEP supports its low-latency kernels under CUDA graphs).

The operators take tensors and a dispatcher id: DeepEP's handle of a dispatch (what its combine needs) is
not a tensor, so a dispatcher keeps its handles in call order (`LowLatencyCalls`) and each combine takes
the oldest, the order every caller keeps (a layer combines what it dispatched before the next layer
dispatches; two overlapped micro-batches combine in the order they dispatched). Operators are registered
once per process, so the id -> calls table they look in is the one process-wide state here.
"""
from __future__ import annotations

import collections
import weakref
from typing import Callable, ClassVar

import torch


class LowLatencyCalls:
    """One dispatcher's side of the operators: how it dispatches and combines, and its handles in flight."""

    registry: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()   # id -> LowLatencyCalls

    def __init__(self, dispatch: Callable, combine: Callable, recv_shape: tuple[int, int, int], hidden_size: int):
        self.dispatch = dispatch       # (x [T, H], topk_idx [T, K]) -> (recv_x [E_local, M, H], recv_count, handle)
        self.combine = combine         # (expert_out, topk_idx, topk_weights, handle) -> [T, H]
        self.recv_shape = recv_shape   # (E_local, M, H)
        self.hidden_size = hidden_size
        self.handles: collections.deque = collections.deque()
        self.id = id(self)
        LowLatencyCalls.registry[self.id] = self

    def clear(self) -> None:
        """At a step boundary: a step that failed between a dispatch and its combine leaves nothing behind."""
        self.handles.clear()


@torch.library.custom_op("moe_runtime::deepep_low_latency_dispatch", mutates_args=())
def low_latency_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, calls_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], topk_idx [T, K] -> recv_x [E_local, M, H] (x's dtype), recv_count [E_local] int64."""
    calls = LowLatencyCalls.registry[calls_id]
    recv_x, recv_count, handle = calls.dispatch(x, topk_idx)
    calls.handles.append(handle)
    return recv_x, recv_count.to(torch.int64)


@low_latency_dispatch.register_fake
def _(x, topk_idx, calls_id):
    experts, capacity, hidden = LowLatencyCalls.registry[calls_id].recv_shape
    return x.new_empty(experts, capacity, hidden), x.new_empty(experts, dtype=torch.int64)


@torch.library.custom_op("moe_runtime::deepep_low_latency_combine", mutates_args=())
def low_latency_combine(expert_out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        calls_id: int) -> torch.Tensor:
    """expert_out [E_local, M, H] (unweighted), the dispatch's topk_idx / topk_weights [T, K] -> [T, H]."""
    calls = LowLatencyCalls.registry[calls_id]
    if not calls.handles:
        raise RuntimeError("DeepEP low-latency combine without a dispatch in flight")
    return calls.combine(expert_out, topk_idx, topk_weights, calls.handles.popleft())


@low_latency_combine.register_fake
def _(expert_out, topk_idx, topk_weights, calls_id):
    return expert_out.new_empty(topk_idx.shape[0], LowLatencyCalls.registry[calls_id].hidden_size)
