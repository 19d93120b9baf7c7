"""The compiled CPU kernels as torch operators (`torch.ops.moe_cpu.*`), so a captured decode step calls them.

A pybind function is opaque to dynamo (a graph break, which `fullgraph=True` refuses). The extension defines
`moe_cpu::routed_expert_mlp`, `moe_cpu::rows_linear` and `moe_cpu::int4_rows_linear` with the dispatcher
(TORCH_LIBRARY in expert_mlp.cpp: a schema and the CPU implementation, called from inductor's wrapper, Python or
C++, without a Python kernel in between); here each gets its fake implementation (the output's shape and dtype, no
data), so dynamo traces it and inductor keeps it as one extern call in the compiled step: the routed experts of a
layer (grouped by expert inside the kernel, llama.cpp's mul_mat_id) and the few-row projections. Every weight
format of the kernels: float32 and bfloat16 (no scales), int8 (a float32 scale per row), FP8 e4m3fn (row-expanded
block scales and their `block_k`), int4 kept packed (`int4_rows_linear`).

`operators()` loads the extension (which defines the operators) and registers the fakes, once per process; the
kernel family asks for it before any step is traced (moe_runtime/kernels/kernel_set.py), so the callers' traced code only
names `torch.ops.moe_cpu.*`. None where the extension did not build.
"""
from __future__ import annotations

import functools

import torch

from moe_runtime.kernels.cpu_native.build import native_experts

NAMESPACE = "moe_cpu"


def _routed_expert_mlp_shape(x, slot_ids, weights, w13, w2, w13_scale=None, w2_scale=None,
                             block_k=0):                        # x [T, H] -> [T, H]
    return torch.empty_like(x)


def _rows_linear_shape(x, weight, scale=None, block_k=0):       # x [M, K], weight [N, K] -> [M, N]
    return x.new_empty(x.shape[0], weight.shape[0])


def _int4_rows_linear_shape(x, values, scale, group_size):      # x [M, K], values [N, ceil(K / 2)] -> [M, N]
    return x.new_empty(x.shape[0], values.shape[0])


@functools.lru_cache(maxsize=None)
def operators():
    """`torch.ops.moe_cpu` with its fake implementations registered, or None without a build."""
    if native_experts() is None:
        return None
    torch.library.register_fake(f"{NAMESPACE}::routed_expert_mlp")(_routed_expert_mlp_shape)
    torch.library.register_fake(f"{NAMESPACE}::rows_linear")(_rows_linear_shape)
    torch.library.register_fake(f"{NAMESPACE}::int4_rows_linear")(_int4_rows_linear_shape)
    return getattr(torch.ops, NAMESPACE)
