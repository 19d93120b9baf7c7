"""The CPU kernel family's expert MLPs and quantized linears: the compiled kernels (expert_mlp.cpp) where they
apply, the torch ones elsewhere.

They apply on the CPU when the kernel could be built (`build.native_experts`): SwiGLU experts without biases,
float32 / bfloat16 / int8 (per-row scales) / FP8 e4m3fn (row-expanded block scales) / int4 (kept packed, groups
of a multiple of 8 consecutive columns or one a row: `native_int4_suits`) weights, float32 or bfloat16
activations; an int8, FP8 or int4 projection at up to `LINEAR_MAX_ROWS` rows (decode), inside a traced step as
its operator (custom_ops.py). FP8 codes are decoded in
registers (exact, subnormals included); NaN codes, which no checkpoint holds, would read as +-480 there where the
torch twin gives NaN, so a weight its load plan found NaN codes in (`bit_decode_suits=False`) takes the twin. gpt-oss's clamped activation, expert biases, other dtypes and devices, int4
with act order's column groups (GPTQ desc_act) or other group sizes, and larger row counts take the torch kernels
(`moe_runtime/kernels/expert_mlp.py`, `int8_weights.py`, `int4_weights.py`), which stay the twins these are tested
against. The grouped-layout entries run
outside a captured step (their counts are read on the host); a captured step calls `cpu_pair_expert_mlp`, the
router's layout as one operator (`torch.ops.moe_cpu.routed_expert_mlp`, custom_ops.py), whose twin is
`moe_runtime/kernels/pair_experts.py`.
"""
from __future__ import annotations

import math

import torch

from moe_runtime.kernels.cpu_native import custom_ops
from moe_runtime.kernels.cpu_native.build import native_experts
from moe_runtime.kernels.expert_activation import ExpertActivation
from moe_runtime.kernels.expert_mlp import (check_expert_biases, check_expert_weights, check_masked_counts,
                                            check_sorted_counts, expert_mlp)
from moe_runtime.kernels.fp8_block_weights import (check_fp8_expert_weights, check_fp8_linear, fp8_expert_mlp,
                                                   fp8_linear_prechecked)
from moe_runtime.kernels.int4_layout import Int4Layout, check_int4_weight
from moe_runtime.kernels.int4_weights import (check_int4_expert_weights, int4_expert_mlp, int4_linear,
                                              int4_masked_expert_mlp)
from moe_runtime.kernels.int8_weights import check_int8_expert_weights, check_int8_weight, int8_expert_mlp, int8_linear
from moe_runtime.kernels.pair_experts import pair_expert_mlp

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_MAX_ROWS = 16   # more rows: the torch GEMM's blocking wins over one pass per weight row
INT4_GROUP_MULTIPLE = 8   # the compiled int4 dots load 8 codes (4 whole bytes) at a time within one group


def compiled_kernels_built() -> bool:
    """Whether the compiled kernels serve on this machine (built now if not yet, their operators registered)."""
    return native_experts() is not None and custom_ops.operators() is not None


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
    applies = activation.is_silu and b13 is None and b2 is None and w13.dtype in ACTIVATION_DTYPES
    native = native_experts() if applies and _on_cpu(x_sorted) and w13.dtype == w2.dtype else None
    if native is None:
        return expert_mlp(x_sorted, counts, w13, w2, b13=b13, b2=b2, activation=activation)
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return native.silu_expert_mlp(x_sorted.contiguous(), _host_counts(counts), w13.contiguous(), w2.contiguous())


def cpu_pair_expert_mlp(
    x: torch.Tensor,          # [T, H]
    slot_ids: torch.Tensor,   # [T, K]
    weights: torch.Tensor,    # [T, K]
    w13: torch.Tensor,        # [E, 2I, H]
    w2: torch.Tensor,         # [E, H, I]
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [T, H], weighted sum over each token's K experts
    """The compiled kernel over the router's pairs where it applies (the family puts this here only where
    `native_experts()` built), else `pair_expert_mlp`. Callable inside a captured step: every check is on
    static properties."""
    applies = (activation.is_silu and b13 is None and b2 is None and x.device.type == "cpu"
               and x.dtype in ACTIVATION_DTYPES and w13.dtype in ACTIVATION_DTYPES and w13.dtype == w2.dtype)
    if not applies:
        return pair_expert_mlp(x, slot_ids, weights, w13, w2, b13=b13, b2=b2, activation=activation)
    check_expert_weights(x.shape[-1], w13, w2)
    return torch.ops.moe_cpu.routed_expert_mlp(x.contiguous(), slot_ids.to(torch.int64).contiguous(),
                                               weights.float().contiguous(), w13.contiguous(), w2.contiguous())


def cpu_int8_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:   # see int8_expert_mlp
    native = native_experts() if _on_cpu(x_sorted) else None
    if native is None:
        return int8_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale)
    check_int8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return native.silu_expert_mlp(x_sorted.contiguous(), _host_counts(counts), w13.contiguous(), w2.contiguous(),
                                  w13_scale.float().contiguous(), w2_scale.float().contiguous())


def cpu_int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:   # see int8_linear
    rows = math.prod(x.shape[:-1])
    traced = _traced(x) and rows <= LINEAR_MAX_ROWS
    native = native_experts() if _on_cpu(x) and rows <= LINEAR_MAX_ROWS else None
    if native is None and not traced:
        return int8_linear(x, weight, scale, bias)
    check_int8_weight(weight, scale)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"int8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] and "
                         f"[N, K]")
    rows_linear = torch.ops.moe_cpu.rows_linear if traced else native.rows_linear
    out = rows_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight.contiguous(),
                      scale.float().reshape(-1).contiguous())   # [T, N]
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def cpu_fp8_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                       w2: torch.Tensor, w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:   # see fp8_expert_mlp
    native = native_experts() if _on_cpu(x_sorted) else None
    if native is None:
        return fp8_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, block_k)
    check_fp8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return native.silu_expert_mlp(x_sorted.contiguous(), _host_counts(counts), w13.contiguous(), w2.contiguous(),
                                  w13_scale.contiguous(), w2_scale.contiguous(), block_k)


def cpu_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                   bias: torch.Tensor | None = None, bit_decode_suits: bool | None = None) -> torch.Tensor:
    """fp8_linear: the compiled kernel at decode row counts, the torch twin elsewhere. `bit_decode_suits`: the
    load plan's word on the weight (`Fp8InMemory.plan`; False where it holds NaN codes), which the twin takes too."""
    rows = math.prod(x.shape[:-1])
    if bit_decode_suits is None:
        check_fp8_linear(x, weight, scale, block_k)
    suits = rows <= LINEAR_MAX_ROWS and bit_decode_suits is not False
    traced = _traced(x) and suits
    native = native_experts() if _on_cpu(x) and suits else None
    if native is None and not traced:
        return fp8_linear_prechecked(x, weight, scale, block_k, bias, bit_decode_suits)
    rows_linear = torch.ops.moe_cpu.rows_linear if traced else native.rows_linear
    out = rows_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight.contiguous(), scale.contiguous(),
                      block_k)   # [T, N]
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def native_int4_suits(layout: Int4Layout) -> bool:
    """Whether the compiled kernel takes int4 weights of this layout: groups of consecutive columns, a multiple of
    INT4_GROUP_MULTIPLE wide, or one group a row. Act order's column groups (a gather per column) and other group
    sizes take the torch kernels (moe_runtime/kernels/int4_weights.py)."""
    return not layout.column_groups and (layout.group_size is None or layout.group_size % INT4_GROUP_MULTIPLE == 0)


def _native_group_size(layout: Int4Layout) -> int:
    return 0 if layout.group_size is None else layout.group_size   # the kernel's 0: one group a row


def cpu_int4_expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor, *, layout: Int4Layout,
                        w13_groups: torch.Tensor | None = None,
                        w2_groups: torch.Tensor | None = None) -> torch.Tensor:   # see int4_expert_mlp
    native = native_experts() if _on_cpu(x_sorted) and native_int4_suits(layout) else None
    if native is None:
        return int4_expert_mlp(x_sorted, counts, w13, w13_scale, w2, w2_scale, layout=layout, w13_groups=w13_groups,
                               w2_groups=w2_groups)
    check_int4_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return native.silu_int4_expert_mlp(x_sorted.contiguous(), _host_counts(counts), w13.contiguous(),
                                       w13_scale.contiguous(), w2.contiguous(), w2_scale.contiguous(),
                                       _native_group_size(layout))


def cpu_int4_masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                               w2: torch.Tensor, w2_scale: torch.Tensor, *, layout: Int4Layout,
                               w13_groups: torch.Tensor | None = None,
                               w2_groups: torch.Tensor | None = None) -> torch.Tensor:   # see int4_masked_expert_mlp
    native = native_experts() if _on_cpu(x) and native_int4_suits(layout) else None
    if native is None:
        return int4_masked_expert_mlp(x, counts, w13, w13_scale, w2, w2_scale, layout=layout, w13_groups=w13_groups,
                                      w2_groups=w2_groups)
    check_int4_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale, layout, w13_groups, w2_groups)
    check_masked_counts(x, counts, w13.shape[0])
    return native.silu_int4_masked_expert_mlp(x.contiguous(), _host_counts(counts), w13.contiguous(),
                                              w13_scale.contiguous(), w2.contiguous(), w2_scale.contiguous(),
                                              _native_group_size(layout))


def cpu_int4_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, layout: Int4Layout,
                    bias: torch.Tensor | None = None,
                    column_groups: torch.Tensor | None = None) -> torch.Tensor:   # see int4_linear
    rows = math.prod(x.shape[:-1])
    suits = rows <= LINEAR_MAX_ROWS and native_int4_suits(layout)
    traced = _traced(x) and suits
    native = native_experts() if _on_cpu(x) and suits else None
    if native is None and not traced:
        return int4_linear(x, values, scales, layout, bias, column_groups)
    check_int4_weight(layout, values, scales, x.shape[-1], column_groups)
    if values.dim() != 2:
        raise ValueError(f"int4_linear: values must be [N, ceil(K/2)], got {tuple(values.shape)}")
    int4_rows_linear = torch.ops.moe_cpu.int4_rows_linear if traced else native.int4_rows_linear
    out = int4_rows_linear(x.reshape(rows, x.shape[-1]).contiguous(), values.contiguous(), scales.contiguous(),
                           _native_group_size(layout))   # [T, N]
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], values.shape[0])


def _on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in ACTIVATION_DTYPES and not torch.compiler.is_compiling()


def _traced(x: torch.Tensor) -> bool:
    """Inside a traced step, where the family hands out these entries only with the kernels built
    (moe_runtime/kernels/kernel_set.py): the call is the operator (`torch.ops.moe_cpu.*`), kept in the graph."""
    return x.device.type == "cpu" and x.dtype in ACTIVATION_DTYPES and torch.compiler.is_compiling()


def _host_counts(counts: torch.Tensor) -> torch.Tensor:
    return counts.to(torch.int64).contiguous()
