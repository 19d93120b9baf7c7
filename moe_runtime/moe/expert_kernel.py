"""The expert half of the MoE seam: run this rank's local experts on tokens a dispatcher grouped.

A dispatcher hands over `recv_x` in one of two layouts (`Dispatcher.layout()`): contiguous, rows
grouped by local expert ([N, H] with `tokens_per_local_expert` rows each), or masked
([E_local, M, H], the first `tokens_per_local_expert[e]` rows of expert e valid). An expert kernel
takes one layout and returns UNWEIGHTED outputs in the same layout; the dispatcher's combine
applies the routing weights. The kernel family (torch, Triton, reference) is the `KernelSet`'s;
experts kept quantized (`ExpertWeights.quant`, FP8, int8, MXFP4 or int4) run through that format's twin of the
same kernel, from the engine's kernel family (the one the format was built with). The experts' biases and
activation (`ExpertWeights.epilogue()`, gpt-oss) and int4 act order's column groups
(`ExpertWeights.column_group_arguments()`) travel as keyword arguments, and only when there are any.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS, LAYOUT_MASKED
from moe_runtime.kernels import KernelSet
from moe_runtime.moe.expert_weights import ExpertWeights


class ExpertKernel(Protocol):
    layout: str  # LAYOUT_CONTIGUOUS or LAYOUT_MASKED: the recv_x it takes and the output it returns

    def __call__(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayoutExpertKernel:
    """One layout's pair of kernels: contiguous, recv_x [N, H] grouped by local expert -> [N, H]; masked,
    recv_x [E_local, M, H] -> [E_local, M, H] with rows past each expert's count undefined (zero
    in the torch twin, unwritten by the Triton kernel): the combine reads only rows below the counts."""

    layout: str
    mlp: Callable      # KernelSet.expert_mlp / masked_expert_mlp(recv_x, counts [E], w13, w2)

    def __call__(self, recv_x: torch.Tensor, tokens_per_local_expert: torch.Tensor,
                 experts: ExpertWeights) -> torch.Tensor:
        epilogue = experts.epilogue()
        if experts.quant is not None:   # the format's twin: fp8_, int8_, mxfp4_ or int4_(masked_)expert_mlp
            return experts.quant.expert_mlp(self.layout == LAYOUT_MASKED, recv_x, tokens_per_local_expert,
                                            experts.w13, experts.w13_scale, experts.w2, experts.w2_scale, **epilogue,
                                            **experts.column_group_arguments())
        return self.mlp(recv_x, tokens_per_local_expert, experts.w13, experts.w2, **epilogue)


def expert_kernel_for(layout: str, kernels: KernelSet) -> ExpertKernel:
    """The kernel family's expert kernel for a dispatcher's layout."""
    if layout == LAYOUT_CONTIGUOUS:
        return LayoutExpertKernel(layout, kernels.expert_mlp)
    if layout == LAYOUT_MASKED:
        return LayoutExpertKernel(layout, kernels.masked_expert_mlp)
    raise ValueError(f"no expert kernel for dispatch layout {layout!r}")
