"""The set of kernel functions one implementation family provides (the engine holds one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    name: str
    select_experts: Callable
    permute_by_expert: Callable
    expert_mlp: Callable           # (x_sorted [N, H], counts [E], w13, w2, *, b13=None, b2=None, activation) -> [N, H]
    masked_expert_mlp: Callable    # (x [E, M, H], counts [E], w13, w2, *, b13=None, b2=None, activation) -> [E, M, H]
    # The routed experts in the router's layout, weighted and summed per token, with fixed shapes: what a captured
    # decode step on one rank calls (moe_runtime/kernels/pair_experts.py; the cpu family's compiled twin groups by expert inside).
    pair_expert_mlp: Callable      # (x [T, H], slot_ids [T, K], weights [T, K], w13, w2, *, epilogue) -> [T, H]
    unpermute_reduce: Callable
    # Unquantized projections and the LM head at any row count (moe_runtime/kernels/skinny_matmul.py's few-row rule over torch;
    # the cpu family's compiled GEMV at decode rows, moe_runtime/kernels/cpu_native/dense_gemv.py).
    linear_rows: Callable          # (x [T, K], weight [N, K], bias=None) -> [T, N]
    fused_moe: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    paged_decode_attention: Callable
    # FP8 block-scaled weights (moe_runtime/kernels/fp8_block_weights.py): weight float8_e4m3fn [..., N, K] with
    # row-expanded scales float32 [..., N, ceil(K / block_k)].
    fp8_linear: Callable             # (x [T, K], weight [N, K], scale [N, Kb], block_k, bias=None) -> [T, N]
    fp8_expert_mlp: Callable         # (x_sorted [N, H], counts [E], w13, w13_scale, w2, w2_scale, block_k) -> [N, H]
    fp8_masked_expert_mlp: Callable  # (x [E, M, H], counts [E], w13, w13_scale, w2, w2_scale, block_k) -> [E, M, H]
    # Int8 weight-only (moe_runtime/kernels/int8_weights.py): weight int8 [..., N, K] with one float32 scale per row [..., N].
    int8_linear: Callable             # (x [T, K], weight [N, K], scale [N], bias=None) -> [T, N]
    int8_expert_mlp: Callable         # (x_sorted [N, H], counts [E], w13, w13_scale, w2, w2_scale) -> [N, H]
    int8_masked_expert_mlp: Callable  # (x [E, M, H], counts [E], w13, w13_scale, w2, w2_scale) -> [E, M, H]
    # MXFP4 (moe_runtime/kernels/mxfp4_weights.py): values uint8 [..., N, ceil(K/32)*16] (two e2m1 codes a byte) with e8m0
    # scales uint8 [..., N, ceil(K/32)]. The expert kernels take b13 / b2 / activation by keyword, as expert_mlp does.
    mxfp4_linear: Callable             # (x [T, K], values [N, Kp], scales [N, G], bias=None) -> [T, N]
    mxfp4_expert_mlp: Callable         # (x_sorted [N, H], counts [E], w13, w13_scale, w2, w2_scale, *, ...) -> [N, H]
    mxfp4_masked_expert_mlp: Callable  # (x [E, M, H], counts [E], w13, w13_scale, w2, w2_scale, *, ...) -> [E, M, H]
    # Int4 weight-only (moe_runtime/kernels/int4_layout.py, int4_weights.py): values uint8 [..., N, ceil(K/2)] with
    # float32 group scales [..., N, G(, 2)] in the engine's `Int4Layout`; act order's column groups by keyword.
    int4_linear: Callable             # (x [T, K], values, scales, layout, bias=None, column_groups=None) -> [T, N]
    int4_expert_mlp: Callable         # (x_sorted [N, H], counts [E], w13, w13_scale, w2, w2_scale, *, layout,
                                      #  w13_groups=None, w2_groups=None) -> [N, H]
    int4_masked_expert_mlp: Callable  # (x [E, M, H], counts [E], w13, w13_scale, w2, w2_scale, *, ...) -> [E, M, H]
