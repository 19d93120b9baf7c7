"""The CPU kernel family's expert MLP: the compiled kernel (expert_mlp.cpp) where it applies, the torch one elsewhere.

It applies to SwiGLU experts without biases, float32 or bfloat16 weights and activations, on the CPU, when the
kernel could be built (`build.native_experts`); gpt-oss's clamped activation, expert biases, other dtypes and
devices take the torch kernel (`kernels/expert_mlp.py`), which stays the twin these are tested against.
"""
from __future__ import annotations

import torch

from kernels.cpu_native.build import native_experts
from kernels.expert_activation import ExpertActivation
from kernels.expert_mlp import check_expert_biases, check_expert_weights, check_sorted_counts, expert_mlp

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
    *,
    b13: torch.Tensor | None = None,   # [E, 2I]
    b2: torch.Tensor | None = None,    # [E, H]
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [N, H], unweighted
    native = native_experts() if _native_applies(x_sorted, w13, w2, b13, b2, activation) else None
    if native is None:
        return expert_mlp(x_sorted, counts, w13, w2, b13=b13, b2=b2, activation=activation)
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return native.silu_expert_mlp(x_sorted.contiguous(), counts.to(torch.int64).contiguous(), w13.contiguous(),
                                  w2.contiguous())


def _native_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13, b2,
                    activation: ExpertActivation) -> bool:
    return (x.device.type == "cpu" and activation.is_silu and b13 is None and b2 is None
            and x.dtype in NATIVE_DTYPES and w13.dtype in NATIVE_DTYPES and w13.dtype == w2.dtype
            and not torch.compiler.is_compiling())   # a captured step keeps the torch kernel: no graph break
