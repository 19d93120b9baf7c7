"""The expert half of the MoE seam: run this rank's local experts on tokens a dispatcher grouped.

A dispatcher hands over `recv_x` in one of two layouts (`Dispatcher.layout()`): contiguous, rows
grouped by local expert ([N, H] with `tokens_per_local_expert` rows each), or masked
([E_local, M, H], the first `tokens_per_local_expert[e]` rows of expert e valid). An expert kernel
takes one layout and returns UNWEIGHTED outputs in the same layout; the dispatcher's combine
applies the routing weights. The kernel family (torch, Triton, reference) is the `KernelSet`'s;
experts kept in FP8 (`ExpertWeights.fp8`) run through the family's FP8 twin of the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dispatch.base import LAYOUT_CONTIGUOUS, LAYOUT_MASKED
from kernels import KernelSet
from moe_runtime.moe.expert_weights import ExpertWeights


class ExpertKernel(Protocol):
    layout: str  # LAYOUT_CONTIGUOUS or LAYOUT_MASKED: the recv_x it takes and the output it returns

    def __call__(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayoutExpertKernel:
    """One layout's pair of kernels: contiguous, recv_x [N, H] grouped by local expert -> [N, H]; masked,
    recv_x [E_local, M, H] -> [E_local, M, H] with rows past each expert's count zero."""

    layout: str
    mlp: Callable      # KernelSet.expert_mlp / masked_expert_mlp(recv_x, counts [E], w13, w2)
    fp8_mlp: Callable  # their FP8 twins (recv_x, counts, w13, w13_scale, w2, w2_scale, block_k)

    def __call__(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor:
        if experts.fp8 is not None:
            return self.fp8_mlp(recv_x, tokens_per_local_expert, experts.w13, experts.w13_scale,
                                experts.w2, experts.w2_scale, experts.fp8.block_k)
        return self.mlp(recv_x, tokens_per_local_expert, experts.w13, experts.w2)


def expert_kernel_for(layout: str, kernels: KernelSet) -> ExpertKernel:
    """The kernel family's expert kernel for a dispatcher's layout."""
    if layout == LAYOUT_CONTIGUOUS:
        return LayoutExpertKernel(layout, kernels.expert_mlp, kernels.fp8_expert_mlp)
    if layout == LAYOUT_MASKED:
        return LayoutExpertKernel(layout, kernels.masked_expert_mlp, kernels.fp8_masked_expert_mlp)
    raise ValueError(f"no expert kernel for dispatch layout {layout!r}")
