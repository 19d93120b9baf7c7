"""Grouped GEMM: every BLOCK_M tile multiplies rows of one expert.

One kernel serves both expert projections: with SWIGLU it computes silu(x @ gate.T) * (x @ up.T)
from w13 [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) in one pass; without it, x @ w2[e].T.
Row gathering (tokens -> tiles) and scattering (tiles -> rows) are folded into the loads/stores.
The epilogue adds the expert's bias row (gpt-oss's b13 / b2) before the activation, and the
activation is the experts' `ExpertActivation` (silu, or gpt-oss's clamped SwiGLU), a constexpr kind
with its alpha / limit as scalars.

MXFP4 weights (`Mxfp4Scales`: packed e2m1 bytes [E, N, ceil(K/32)*16] with e8m0 scales [E, N,
ceil(K/32)], moe_runtime/kernels/mxfp4_weights.py) are decoded tile by tile in registers (mxfp4_tiles.py): each
BLOCK_K column picks its nibble and its 32-column block's power of two, and the fp32 tile is cast to
the activations' dtype for tl.dot, as FP8's dequantize path does.

Tiles come from one of two row layouts (`tile_rows`):
- a BlockSchedule (align.py): tile -> expert and padded slots -> source rows, built on the device
  from the counts (contiguous layout, fused MoE, dense linears);
- the masked layout (masked_layout.py, DeepEP low-latency [E, M, H]): a fixed grid of
  E * ceil(M / BLOCK_M) tiles, each reading counts[e] on the device and exiting past it. No
  schedule, no host read, no zero fill: output rows past counts[e] are undefined.

FP8 weights (`BlockScales`: float8_e4m3fn, row-expanded block scales [E, N, ceil(K / block_k)], see
moe_runtime/kernels/fp8_block_weights.py) are multiplied one of two ways, the kernel set's `Fp8Scheme`
(fp8_scheme.py), chosen once by device capability:
- dequantize (FP8_WEIGHTS without FP8_ACTIVATIONS; GPUs below sm89, the interpreter's default):
  each weight tile is loaded as FP8 (or as its bytes, fp8_e4m3.py), converted to fp32, multiplied by
  its k-block's scale, cast to the activations' dtype and fed to tl.dot. BLOCK_K divides block_k so a
  tile needs one scale per weight row; where no power of two >= 16 divides block_k, each element
  looks up its own block's scale (SCALE_PER_ELEMENT).
- FP8 activations (FP8_ACTIVATIONS; sm89+): `a` arrives quantized per token and 128 columns
  (fp8_activations.py), and each BLOCK_K tile, inside one activation group and one weight block, is
  ONE fp8 x fp8 dot accumulated in fp32 and scaled by a_scale[m, k0 // 128] * w_scale[n, k0 // block_k]
  (DeepGEMM's scheme). What runs where: compiled on sm89+ (NATIVE_DOT) `tl.dot` takes the two
  float8e4nv tiles; in the Triton interpreter (and wherever NATIVE_DOT is off) both tiles are decoded
  to fp32, exactly, and dotted in ieee fp32, so the CPU tests check the quantized activations, the
  per-block scales and the fp32 accumulation against a float64 reference, but not the fp8 MMA itself
  (its in-tile accumulation precision is the GPU check's to measure).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..expert_mlp import check_expert_biases, check_expert_weights, check_sorted_counts
from .align import BlockSchedule, schedule_from_counts
from .fp8_activations import QuantizedActivations, quantize_activations
from .fp8_e4m3 import e4m3_bits_to_float, fp8_tile_to_float
from .fp8_scheme import ACTIVATION_GROUP, Fp8Scheme
from .masked_layout import MaskedRows, check_masked_layout
from .mxfp4_tiles import mxfp4_tile_to_float
from ..expert_activation import ExpertActivation

MIN_DOT_K = 16        # tl.dot's smallest K
MAX_BLOCK_K = 64

Tiles = BlockSchedule | MaskedRows


@dataclass(frozen=True)
class Mxfp4Scales:
    """The e8m0 block exponents of an MXFP4 weight operand (moe_runtime/kernels/mxfp4_weights.py): scale[e, n, j]
    (uint8) multiplies columns j*32 .. j*32+31 of w[e, n] by 2^(scale - 127)."""

    scale: torch.Tensor   # [E, N, ceil(K / 32)] uint8


@dataclass(frozen=True)
class ExpertEpilogue:
    """What an expert projection adds after its dot: a bias row per expert (optional) and, for the
    gate/up projection, the activation."""

    bias: torch.Tensor | None = None                 # [E, N] (N = 2I for w13, gate rows then up rows)
    activation: ExpertActivation = ExpertActivation()


@dataclass(frozen=True)
class BlockScales:
    """Row-expanded block scales of an FP8 weight operand.

    scale[e, n, j] multiplies w[e, n, j*block_k : (j+1)*block_k].
    """

    scale: torch.Tensor   # [E, N, ceil(K / block_k)] float32
    block_k: int


@triton.jit
def tile_rows(tile, padded_rows_ptr, block_expert_ptr, counts_ptr, capacity, tiles_per_expert,
              MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, slots, rows, valid, dead) of one tile: slots index intermediate tensors, rows the
    gathered / scattered ones; in the masked layout the two are the same."""
    if MASKED:
        expert = (tile // tiles_per_expert).to(tl.int64)
        start = (tile % tiles_per_expert) * BLOCK_M
        local = start + tl.arange(0, BLOCK_M)
        count = tl.minimum(tl.maximum(tl.load(counts_ptr + expert).to(tl.int64), 0), capacity)
        valid = local < count
        rows = tl.where(valid, expert * capacity + local, -1)
        slots = rows
        dead = start >= count
    else:
        expert = tl.load(block_expert_ptr + tile).to(tl.int64)
        slots = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows = tl.load(padded_rows_ptr + slots)                           # [BM] int64, -1 = padding
        valid = rows >= 0
        dead = expert < 0
    return expert, slots, rows, valid, dead


@triton.jit
def load_weight_tile(w_base, s_base, rows, ks, k0, row_ok, k_ok, stride_wn, stride_wk, stride_sn, stride_sk,
                     scale_block_k, FP8_WEIGHTS: tl.constexpr, E4M3_BYTES: tl.constexpr,
                     SCALE_PER_ELEMENT: tl.constexpr, MXFP4_WEIGHTS: tl.constexpr):
    """The [BK, BN] tile w[rows, ks].T: as stored, or with FP8_WEIGHTS / MXFP4_WEIGHTS dequantized to fp32
    with its block scales."""
    mask = k_ok[:, None] & row_ok[None, :]
    if MXFP4_WEIGHTS:   # two e2m1 codes a byte (k even: low nibble), one e8m0 exponent per 32 columns
        packed = tl.load(w_base + rows[None, :] * stride_wn + (ks[:, None] // 2) * stride_wk, mask=mask, other=0)
        exponents = tl.load(s_base + rows[None, :] * stride_sn + (ks[:, None] // 32) * stride_sk, mask=mask,
                            other=127)
        return mxfp4_tile_to_float(packed, ks[:, None] % 2, exponents)
    w = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] * stride_wk, mask=mask, other=0.0)
    if FP8_WEIGHTS:
        if SCALE_PER_ELEMENT:
            scale = tl.load(s_base + rows[None, :] * stride_sn + (ks[:, None] // scale_block_k) * stride_sk,
                            mask=mask, other=0.0)                             # [BK, BN]
        else:
            scale = tl.load(s_base + rows * stride_sn + (k0 // scale_block_k) * stride_sk,
                            mask=row_ok, other=0.0)[None, :]                  # [1, BN]: one k-block per tile
        w = fp8_tile_to_float(w, E4M3_BYTES) * scale
    return w


@triton.jit
def fp8_block_dot(a, a_scale, w_base, s_base, rows, ks, k0, row_ok, k_ok, stride_wn, stride_wk, stride_sn,
                  stride_sk, scale_block_k, NATIVE_DOT: tl.constexpr, E4M3_BYTES: tl.constexpr):
    """One K tile of the FP8-activation scheme: (a [BM, BK] fp8 . w[rows, ks].T fp8) in fp32, times
    a_scale [BM] * w's k-block scale [BN]."""
    w = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=k_ok[:, None] & row_ok[None, :], other=0.0)              # [BK, BN] FP8 codes
    w_scale = tl.load(s_base + rows * stride_sn + (k0 // scale_block_k) * stride_sk, mask=row_ok, other=0.0)
    if NATIVE_DOT:
        part = tl.dot(a, w, out_dtype=tl.float32)
    else:
        part = tl.dot(e4m3_bits_to_float(a), fp8_tile_to_float(w, E4M3_BYTES), input_precision="ieee")
    return part * a_scale[:, None] * w_scale[None, :]


@triton.jit
def gated_activation(gate, up, alpha, limit, CLAMPED_SWIGLU: tl.constexpr, CLAMPED_SILU: tl.constexpr):
    """silu(gate) * up, or gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
    or DeepSeek-V4's silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if CLAMPED_SILU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif CLAMPED_SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    return out


@triton.jit
def grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, out_ptr, padded_rows_ptr, block_expert_ptr, counts_ptr, scale_ptr, bias_ptr,
    N, K, up_offset, a_row_divisor, scale_block_k, capacity, tiles_per_expert, alpha, limit,
    stride_am, stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_se, stride_sn, stride_sk, stride_be, stride_bn,
    MASKED: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, SWIGLU: tl.constexpr,
    PRECISION: tl.constexpr, FP8_WEIGHTS: tl.constexpr, E4M3_BYTES: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr,
    FP8_ACTIVATIONS: tl.constexpr, NATIVE_DOT: tl.constexpr, ACT_GROUP: tl.constexpr,
    MXFP4_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, CLAMPED_SILU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, slots, rows, valid, dead = tile_rows(tl.program_id(0), padded_rows_ptr, block_expert_ptr, counts_ptr,
                                                 capacity, tiles_per_expert, MASKED, BLOCK_M)
    if dead:
        return
    if GATHER_A:
        a_rows = tl.where(valid, rows // a_row_divisor, 0)
    else:
        a_rows = tl.where(valid, slots, 0)
    if SCATTER_OUT:
        out_rows = tl.where(valid, rows, 0)
    else:
        out_rows = tl.where(valid, slots, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    s_base = scale_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)       # [BM, BK]
        if FP8_ACTIVATIONS:
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // ACT_GROUP) * stride_ask, mask=valid, other=0.0)
            acc += fp8_block_dot(a, a_scale, w_base, s_base, cols, ks, k0, col_ok, k_ok, stride_wn, stride_wk,
                                 stride_sn, stride_sk, scale_block_k, NATIVE_DOT, E4M3_BYTES)
            if SWIGLU:
                acc_up += fp8_block_dot(a, a_scale, w_base, s_base, cols + up_offset, ks, k0, col_ok, k_ok,
                                        stride_wn, stride_wk, stride_sn, stride_sk, scale_block_k, NATIVE_DOT,
                                        E4M3_BYTES)
        else:
            w = load_weight_tile(w_base, s_base, cols, ks, k0, col_ok, k_ok, stride_wn, stride_wk, stride_sn,
                                 stride_sk, scale_block_k, FP8_WEIGHTS, E4M3_BYTES, SCALE_PER_ELEMENT,
                                 MXFP4_WEIGHTS)                                            # [BK, BN]
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
            if SWIGLU:
                w_up = load_weight_tile(w_base, s_base, cols + up_offset, ks, k0, col_ok, k_ok, stride_wn, stride_wk,
                                        stride_sn, stride_sk, scale_block_k, FP8_WEIGHTS, E4M3_BYTES,
                                        SCALE_PER_ELEMENT, MXFP4_WEIGHTS)
                acc_up += tl.dot(a, w_up.to(a.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc += tl.load(b_base + cols * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_base + (cols + up_offset) * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc = gated_activation(acc, acc_up, alpha, limit, CLAMPED_SWIGLU, CLAMPED_SILU)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def pick_block_m(num_rows: int, num_experts: int) -> int:
    return 16 if num_rows <= 32 * max(num_experts, 1) else 64


def pick_block_k(k_dim: int, scales: BlockScales | None) -> int:
    """BLOCK_K: up to MAX_BLOCK_K; with FP8 weights also a divisor of block_k where a power of two >= 16 is."""
    block_k = min(MAX_BLOCK_K, max(MIN_DOT_K, triton.next_power_of_2(k_dim)))
    if scales is not None:
        divisor = scales.block_k & -scales.block_k                        # largest power of two dividing it
        if divisor >= MIN_DOT_K:
            block_k = min(block_k, divisor)
    return block_k


def run_grouped_gemm(a: torch.Tensor | QuantizedActivations, w, out, tiles: Tiles, *, swiglu: bool, gather_a: bool,
                     scatter_out: bool, a_row_divisor: int = 1, scales: BlockScales | Mxfp4Scales | None = None,
                     dot_block_k: int | None = None, epilogue: ExpertEpilogue = ExpertEpilogue()) -> None:
    """out[rows] = (activation of) a[rows] @ w[expert].T (+ bias[expert]) for every tile.

    With `scales` (BlockScales), w is an FP8 weight: float8_e4m3fn, or its uint8 view for the bytes path
    (fp8_e4m3.py); with Mxfp4Scales, w holds packed e2m1 bytes [E, N, ceil(K/32)*16] and K is a's width.
    With `a` quantized (QuantizedActivations) the FP8-activation scheme runs with BLOCK_K = dot_block_k
    (Fp8Scheme.dot_block_k): native fp8 dots when a's codes are float8_e4m3fn, decoded ones when uint8.
    """
    mxfp4 = isinstance(scales, Mxfp4Scales)
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    k_dim = (a.values if isinstance(a, QuantizedActivations) else a).shape[1] if mxfp4 else w.shape[2]
    if tiles.num_blocks == 0 or n_out == 0:
        return
    fp8_activations = isinstance(a, QuantizedActivations)
    if fp8_activations and (scales is None or dot_block_k is None):
        raise ValueError("run_grouped_gemm: quantized activations need FP8 weights and the scheme's BLOCK_K")
    a_values, a_scales = (a.values, a.scales) if fp8_activations else (a, a)   # a as scales: unread
    if mxfp4 and fp8_activations:
        raise ValueError("run_grouped_gemm: MXFP4 weights take activations in their dtype, not quantized")
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = dot_block_k if fp8_activations else pick_block_k(k_dim, None if mxfp4 else scales)
    scale = w if scales is None else scales.scale                         # unread without FP8 / MXFP4 weights
    scale_block_k = 1 if scales is None or mxfp4 else scales.block_k
    bias = epilogue.bias
    activation = epilogue.activation
    masked = isinstance(tiles, MaskedRows)
    # Each layout reads its own tensors; the other's pointers are filled with any tensor, unread.
    padded_rows, block_expert, counts = ((tiles.counts, tiles.counts, tiles.counts) if masked else
                                         (tiles.padded_rows, tiles.block_expert, tiles.padded_rows))
    grid = (tiles.num_blocks, triton.cdiv(n_out, block_n))
    grouped_gemm_kernel[grid](
        a_values, a_scales, w, out, padded_rows, block_expert, counts, scale, w if bias is None else bias,
        n_out, k_dim, n_out, a_row_divisor, scale_block_k,
        tiles.capacity if masked else 0, tiles.tiles_per_expert if masked else 1,
        float(activation.alpha), float(activation.limit),
        a_values.stride(0), a_values.stride(1), *(a_scales.stride() if fp8_activations else (0, 0)),
        w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        *(scale.stride() if scales is not None else (0, 0, 0)),
        *(bias.stride() if bias is not None else (0, 0)),
        MASKED=masked, GATHER_A=gather_a, SCATTER_OUT=scatter_out, SWIGLU=swiglu,
        PRECISION="ieee" if a_values.dtype == torch.float32 else "tf32",
        FP8_WEIGHTS=scales is not None and not mxfp4, E4M3_BYTES=w.dtype == torch.uint8 and not mxfp4,
        SCALE_PER_ELEMENT=scales is not None and not mxfp4 and not fp8_activations and scale_block_k % block_k != 0,
        FP8_ACTIVATIONS=fp8_activations, NATIVE_DOT=fp8_activations and a_values.dtype != torch.uint8,
        ACT_GROUP=ACTIVATION_GROUP, MXFP4_WEIGHTS=mxfp4, HAS_BIAS=bias is not None,
        CLAMPED_SWIGLU=swiglu and activation.kind == "gpt_oss_clamped_swiglu",
        CLAMPED_SILU=swiglu and activation.kind == "clamped_silu",
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def quantized_for(x: torch.Tensor, tiles: Tiles, scheme: Fp8Scheme, *, slots: bool) -> QuantizedActivations:
    """x's rows quantized per token and 128 columns, only those the GEMM reads: in the masked layout the
    rows below each count; with `slots` (x in padded-slot order) the slots holding a row; else all."""
    if isinstance(tiles, MaskedRows):
        return quantize_activations(x, scheme, tiles.counts, tiles.capacity)
    return quantize_activations(x, scheme, padded_rows=tiles.padded_rows if slots else None)


def swiglu_then_down(a, tiles: Tiles, w13, w2, out, *, gather_a: bool, scatter_out: bool, a_row_divisor: int = 1,
                     w13_scales: BlockScales | Mxfp4Scales | None = None,
                     w2_scales: BlockScales | Mxfp4Scales | None = None, scheme: Fp8Scheme | None = None,
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     activation_kind: ExpertActivation = ExpertActivation()) -> None:
    """Both expert projections over one tiling; the [P, I] activation lives in slot order.

    With FP8 weights and a `scheme` whose FP8-activation GEMM fits their block_k, both projections'
    inputs are quantized first (x, then the SwiGLU activation in a's dtype). b13 [E, 2I] / b2 [E, H] and
    `activation_kind` are the experts' epilogues."""
    intermediate = w13.shape[1] // 2
    activation = torch.empty(tiles.num_slots, intermediate, dtype=a.dtype, device=a.device)   # [P, I]
    fits = scheme is not None and isinstance(w13_scales, BlockScales) and isinstance(w2_scales, BlockScales)
    up_k = scheme.dot_block_k(w13.shape[2], w13_scales.block_k) if fits else None
    down_k = scheme.dot_block_k(w2.shape[2], w2_scales.block_k) if fits else None
    up_in = a if up_k is None else quantized_for(a, tiles, scheme, slots=False)
    run_grouped_gemm(up_in, w13, activation, tiles, swiglu=True, gather_a=gather_a, scatter_out=False,
                     a_row_divisor=a_row_divisor, scales=w13_scales, dot_block_k=up_k,
                     epilogue=ExpertEpilogue(b13, activation_kind))
    down_in = activation if down_k is None else quantized_for(activation, tiles, scheme, slots=True)
    run_grouped_gemm(down_in, w2, out, tiles, swiglu=False, gather_a=False, scatter_out=scatter_out,
                     scales=w2_scales, dot_block_k=down_k, epilogue=ExpertEpilogue(b2))


def sorted_experts(x_sorted, counts, w13, w2, *, w13_scales: BlockScales | Mxfp4Scales | None = None,
                   w2_scales: BlockScales | Mxfp4Scales | None = None, scheme: Fp8Scheme | None = None,
                   **epilogues) -> torch.Tensor:
    """The contiguous layout's expert MLP once validated: [N, H] rows grouped by expert -> [N, H].
    `epilogues`: b13, b2, activation_kind (swiglu_then_down)."""
    num_rows = x_sorted.shape[0]
    out = torch.empty(num_rows, w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    row_start = torch.cumsum(counts, dim=0) - counts                       # [E]
    schedule = schedule_from_counts(counts, row_start, num_rows, pick_block_m(num_rows, w13.shape[0]))
    swiglu_then_down(x_sorted, schedule, w13, w2, out, gather_a=True, scatter_out=True,
                     w13_scales=w13_scales, w2_scales=w2_scales, scheme=scheme, **epilogues)
    return out


def masked_experts(x, counts, w13, w2, *, w13_scales: BlockScales | Mxfp4Scales | None = None,
                   w2_scales: BlockScales | Mxfp4Scales | None = None, scheme: Fp8Scheme | None = None,
                   **epilogues) -> torch.Tensor:
    """The masked layout's expert MLP once validated: [E, M, H] -> [E, M, H]; rows past counts[e] are
    undefined (masked_layout.py: never written, never read)."""
    num_experts, capacity, hidden = x.shape
    out = torch.empty(num_experts * capacity, w2.shape[1], dtype=x.dtype, device=x.device)  # [E*M, H]
    tiles = MaskedRows(counts, capacity, pick_block_m(capacity, 1))
    swiglu_then_down(x.reshape(num_experts * capacity, hidden), tiles, w13, w2, out, gather_a=True,
                     scatter_out=True, w13_scales=w13_scales, w2_scales=w2_scales, scheme=scheme, **epilogues)
    return out.view(num_experts, capacity, w2.shape[1])


def expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
               b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
               activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    check_expert_weights(x_sorted.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_sorted_counts(x_sorted, counts, w13.shape[0])
    return sorted_experts(x_sorted, counts, w13, w2, b13=b13, b2=b2, activation_kind=activation)


def masked_expert_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: ExpertActivation = ExpertActivation()) -> torch.Tensor:
    """[E, M, H] -> [E, M, H], rows past counts[e] undefined; no host read (masked_layout.py)."""
    check_expert_weights(x.shape[-1], w13, w2)
    check_expert_biases(w13, w2, b13, b2)
    check_masked_layout(x, counts, w13.shape[0])
    return masked_experts(x, counts, w13, w2, b13=b13, b2=b2, activation_kind=activation)
