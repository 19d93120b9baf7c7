"""The compiled CPU kernels as torch operators (`torch.ops.moe_cpu.*`), so a captured decode step calls them.

A pybind function is opaque to dynamo (a graph break, which `fullgraph=True` refuses). As operators registered
through `torch.library` with a fake implementation (the output's shape and dtype, no data), dynamo traces them
and inductor keeps each as one extern call in the compiled step: the routed experts of a layer (grouped by
expert inside the kernel, llama.cpp's mul_mat_id) and the few-row projections (`rows_linear`).

They are only called where `native_experts()` built (the callers decide before tracing: kernels/kernel_set.py
and kernels/cpu_native/dense_gemv.py); the float32 / bfloat16 checks are the kernel's own (TORCH_CHECK).
Registration is at import, as torch.library registers every operator: importing this module twice is a no-op.
"""
from __future__ import annotations

import torch

from kernels.cpu_native.build import native_experts

NAMESPACE = "moe_cpu"


@torch.library.custom_op(f"{NAMESPACE}::routed_expert_mlp", mutates_args=(), device_types="cpu")
def routed_expert_mlp(
    x: torch.Tensor,          # [T, H] float32 / bfloat16
    slot_ids: torch.Tensor,   # [T, K] int64
    weights: torch.Tensor,    # [T, K] float32
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
) -> torch.Tensor:            # [T, H]: sum over k of weights[t, k] * SwiGLU expert slot_ids[t, k] of x[t]
    return native_experts().routed_expert_mlp(x, slot_ids, weights, w13, w2)


@routed_expert_mlp.register_fake
def _routed_expert_mlp_shape(x, slot_ids, weights, w13, w2):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::rows_linear", mutates_args=(), device_types="cpu")
def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:   # x [M, K], weight [N, K] -> [M, N]
    return native_experts().rows_linear(x, weight)


@rows_linear.register_fake
def _rows_linear_shape(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])
