"""`--cpu-experts`: the routed experts held in host memory and run by the CPU kernels on their own thread.

KTransformers' split: the router, attention and the shared experts run on the accelerator while the routed
experts run on the CPU from host memory, the two at once. Here that is an expert kernel (`HostExpertKernel`,
contiguous layout, so any dispatcher but DeepEP's masked one pairs with it) whose `start` hands the rows of the
host experts to a worker thread and returns at once; `ModularMoE` runs the block's work alongside there
(`Alongside`: `SparseMoE`'s shared experts), then waits. The host kernels are the cpu family's
(moe_runtime/kernels/cpu_native: weights streamed once per step for all the rows of an expert, fused SwiGLU), which release
the GIL, so the worker computes while the caller's thread goes on. On a CPU-only machine the "device" is the
CPU as well: the same split runs with both sides on it, which is how its exactness and its overlap are tested.

Slots with a copy on the device (`DeviceResidentExperts`, `--device-resident-experts`) run there with the
engine's kernel family, on the caller's thread, while the worker runs the others.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS
from moe_runtime.kernels import KernelSet
from moe_runtime.moe.device_resident_experts import DeviceResidentExperts
from moe_runtime.moe.expert_kernel import ExpertKernel
from moe_runtime.moe.expert_weights import ExpertWeights

HOST = torch.device("cpu")
WORKER_THREAD = "moe-host-experts"    # the worker thread's name prefix


@runtime_checkable
class StartedExpertKernel(Protocol):
    """An expert kernel whose work runs elsewhere: `start` returns at once, the result comes by `.wait()`."""

    layout: str

    def start(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
              experts: ExpertWeights) -> "RunningExperts": ...


@dataclass
class RunningExperts:
    """The routed experts of one layer in flight: the host rows on the worker, the device rows already launched."""

    future: Future                      # -> [N_host, H] on the host
    host_rows: torch.Tensor | None      # [N_host] rows of recv_x the host computes (None: all of them)
    device_rows: torch.Tensor | None    # [N_dev] rows the device copies computed
    device_out: torch.Tensor | None     # [N_dev, H]
    shape: tuple[int, int]
    like: torch.Tensor                  # recv_x: the output's dtype and device

    def wait(self) -> torch.Tensor:  # -> [N, H] unweighted, on recv_x's device
        host_out = self.future.result().to(self.like.device, non_blocking=True)
        if self.host_rows is None:
            return host_out
        out = torch.empty(self.shape, dtype=self.like.dtype, device=self.like.device)
        out[self.host_rows] = host_out
        out[self.device_rows] = self.device_out
        return out


class HostExpertKernel:
    """The contiguous-layout expert kernel of `--cpu-experts` (see the module's top)."""

    layout = LAYOUT_CONTIGUOUS

    def __init__(self, host_kernels: KernelSet, device_kernel: ExpertKernel):
        self.host_kernels = host_kernels      # the cpu family: compiled kernels where they apply, torch elsewhere
        self.device_kernel = device_kernel    # the engine's family, for the device-resident copies
        self.resident: dict[int, DeviceResidentExperts] = {}   # id(host ExpertWeights) -> its device copies
        self.host_mlp: Callable[[torch.Tensor, torch.Tensor, ExpertWeights], torch.Tensor] = self._host_mlp
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD)

    def keep_on_device(self, copies: DeviceResidentExperts) -> None:
        self.resident[id(copies.host)] = copies

    def __call__(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor:
        return self.start(recv_x, tokens_per_local_expert, experts).wait()

    def start(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
              experts: ExpertWeights) -> RunningExperts:  # recv_x [N, H] grouped by local slot, counts [E_local]
        counts = tokens_per_local_expert.to(HOST, torch.long)                     # [E_local]
        shape = (recv_x.shape[0], recv_x.shape[1])
        copies = self.resident.get(id(experts))
        if copies is None:
            future = self._submit(recv_x.to(HOST), counts, experts)
            return RunningExperts(future, None, None, None, shape, recv_x)
        on_device = copies.mask                                                   # [E_local] bool
        row_on_device = on_device.repeat_interleave(counts)                       # [N]
        host_rows = (~row_on_device).nonzero().squeeze(1).to(recv_x.device)      # [N_host]
        device_rows = row_on_device.nonzero().squeeze(1).to(recv_x.device)      # [N_dev]
        future = self._submit(recv_x[host_rows].to(HOST), counts.masked_fill(on_device, 0), experts)
        device_counts = counts[copies.slots].to(recv_x.device)                    # [N_resident]
        device_out = self.device_kernel(recv_x[device_rows], device_counts, copies.copies)   # [N_dev, H]
        return RunningExperts(future, host_rows, device_rows, device_out, shape, recv_x)

    def _submit(self, x_host: torch.Tensor, counts: torch.Tensor, experts: ExpertWeights) -> Future:
        return self._worker.submit(_in_inference_mode, self.host_mlp, x_host, counts, experts)

    def _host_mlp(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """[N, H] rows grouped by local slot (counts [E_local]) through the host stack -> [N, H], unweighted."""
        k = self.host_kernels
        if experts.quant is None:
            return k.expert_mlp(x, counts, experts.w13, experts.w2, **experts.epilogue())
        if experts.quant.name == "fp8":
            return k.fp8_expert_mlp(x, counts, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                                    experts.quant.block_k)
        return k.int8_expert_mlp(x, counts, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale)


def _in_inference_mode(run: Callable, *args) -> torch.Tensor:
    """The worker has its own thread-local grad mode: the caller's inference mode does not carry over."""
    with torch.inference_mode():
        return run(*args)
