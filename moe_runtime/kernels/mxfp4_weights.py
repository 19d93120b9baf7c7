"""MXFP4 weights kept in MXFP4 (`--quantization mxfp4`): decoded one row chunk at a time (the torch family).

Layout (OCP microscaling, as gpt-oss's checkpoints store experts): a weight [..., N, K] is
`values` uint8 [..., N, G * 16] and `scales` uint8 [..., N, G], G = ceil(K / 32). Byte j of a row
holds columns 2j (low nibble) and 2j + 1 (high nibble) as e2m1 codes (sign bit 3, exponent bits 2-1,
mantissa bit 0: the 16 values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}); scale byte g is an e8m0 exponent,
columns 32g .. 32g + 31 are multiplied by 2^(scale - 127). Columns past K (when K is not a multiple
of 32) are zero codes. This is transformers' `convert_moe_packed_tensors` reading of `*_blocks` /
`*_scales` (integrations/mxfp4.py), with the blocks' [G, 16] flattened to one byte row: an expert
slot is then a plain byte row, which migration moves as it moves FP8 or int8 slots.

Kernels: like FP8 (fp8_block_weights.py), every matmul decodes at most CHUNK_BYTES of fp32 weight at
a time into one scratch buffer (`chunked_weights.chunked_matmul`) and multiplies it: a 16-entry table
lookup per nibble and one multiply by the block's power of two, exact in fp32 (every e2m1 value times
a power of two is an fp32 number for exponents within fp32's range), so the product is the
dequantized weight's up to fp32 summation order. The activations are zero-padded to G * 32 columns
so a chunk decodes whole 32-column blocks.
"""
from __future__ import annotations

import math

import torch

from .chunked_weights import chunked_matmul
from .expert_activation import ExpertActivation, add_bias_
from .expert_mlp import busy_segments, check_masked_counts, check_sorted_counts, masked_segments

MXFP4_BLOCK = 32                 # values per e8m0 scale
E8M0_BIAS = 127
E2M1_MAX = 6.0


def block_count(columns: int) -> int:
    return -(-columns // MXFP4_BLOCK)


def packed_columns(columns: int) -> int:
    """Bytes per row of a `columns`-wide weight: two codes a byte, whole 32-column blocks."""
    return block_count(columns) * MXFP4_BLOCK // 2


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """[16] float32: the value of each e2m1 code (code 8 is -0.0)."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return torch.tensor(magnitudes + [-m for m in magnitudes], dtype=torch.float32, device=device)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> float32 2^(s - 127), exactly: the byte is fp32's exponent field (s = 0 is the
    subnormal 2^-127, s = 255 e8m0's NaN)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def check_mxfp4_weight(values: torch.Tensor, scales: torch.Tensor, columns: int, name: str = "weight") -> None:
    """Validate one MXFP4 weight of `columns` input columns: values uint8 [..., N, G*16], scales uint8 [..., N, G]."""
    groups = block_count(columns)
    if values.dtype != torch.uint8 or values.dim() < 2 or values.shape[-1] != groups * MXFP4_BLOCK // 2:
        raise ValueError(f"{name} must be uint8 [..., N, {groups * MXFP4_BLOCK // 2}] (packed e2m1 of {columns} "
                         f"columns), got {values.dtype} {tuple(values.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (*values.shape[:-1], groups):
        raise ValueError(f"{name}_scale must be uint8 {(*values.shape[:-1], groups)} (e8m0 exponents of 32-column "
                         f"blocks), got {scales.dtype} {tuple(scales.shape)}")


def check_mxfp4_expert_weights(hidden: int, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                               w2_scale: torch.Tensor) -> int:
    """Validate MXFP4 w13 [E, 2I, packed(H)] / w2 [E, H, packed(I)] and their scales; return I."""
    if w13.dim() != 3 or w13.shape[1] % 2 or w2.dim() != 3 or w2.shape[:2] != (w13.shape[0], hidden):
        raise ValueError(f"MXFP4 w13 must be [E, 2I, *] and w2 [E, H={hidden}, *], got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    intermediate = w13.shape[1] // 2
    check_mxfp4_weight(w13, w13_scale, hidden, "w13")
    check_mxfp4_weight(w2, w2_scale, intermediate, "w2")
    return intermediate


def decode_rows_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> None:
    """out [R, G*32] fp32 (contiguous) = values [R, G*16] decoded, times 2^(scales [R, G] - 127)."""
    rows = out.shape[0]
    blocks = out.view(rows, -1, MXFP4_BLOCK)                               # [R, G, 32]
    packed = values.view(rows, -1, MXFP4_BLOCK // 2)                       # [R, G, 16]
    blocks[..., 0::2] = table[(packed & 0x0F).long()]
    blocks[..., 1::2] = table[(packed >> 4).long()]
    blocks.mul_(e8m0_to_float(scales).unsqueeze(-1))


def dequantize_mxfp4(values: torch.Tensor, scales: torch.Tensor, columns: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole dequantized weight [..., N, columns] (for loading, tests and the reference family)."""
    check_mxfp4_weight(values, scales, columns)
    rows = values.reshape(-1, values.shape[-1])
    out = torch.empty(rows.shape[0], rows.shape[1] * 2, dtype=torch.float32, device=values.device)
    if rows.shape[0]:
        decode_rows_into(out, rows, scales.reshape(-1, scales.shape[-1]), e2m1_table(values.device))
    return out[:, :columns].to(dtype).reshape(*values.shape[:-1], columns)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (any float dtype) -> (values uint8 [..., N, G*16], scales uint8 [..., N, G]).

    Each 32-column block gets the smallest power of two that brings its largest magnitude within
    e2m1's 6 (OCP's rule), and each value the nearest e2m1 code. Weights that are already e2m1 values
    times a per-block power of two come back exactly (tests and checkpoint twins rely on it)."""
    columns = weight.shape[-1]
    groups = block_count(columns)
    w = weight.float().reshape(-1, columns)
    padded = w.new_zeros(w.shape[0], groups * MXFP4_BLOCK)
    padded[:, :columns] = w
    blocks = padded.view(-1, groups, MXFP4_BLOCK)                          # [R, G, 32]
    amax = blocks.abs().amax(dim=-1)                                       # [R, G]
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)) / E2M1_MAX))
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / torch.pow(2.0, exponent).unsqueeze(-1)               # |scaled| <= 6
    table = e2m1_table(weight.device)
    magnitudes = table[:8]
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # [R, G, 32] nearest magnitude
    codes = codes + 8 * ((scaled < 0) & (codes > 0)).long()
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)   # [R, G, 16]
    values = packed.reshape(*weight.shape[:-1], groups * MXFP4_BLOCK // 2)
    scales = (exponent + E8M0_BIAS).to(torch.uint8).reshape(*weight.shape[:-1], groups)
    return values.contiguous(), scales.contiguous()


def mxfp4_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ dequantized(values [N, G*16]).T -> [T, N] in compute_dtype(x), CHUNK_BYTES of weight at a time."""
    padded_columns = values.shape[1] * 2
    if x.shape[1] != padded_columns:                                       # whole blocks: pad x with zeros
        x = torch.nn.functional.pad(x, (0, padded_columns - x.shape[1]))
    table = e2m1_table(values.device)

    def decode(rows: torch.Tensor, start: int, stop: int) -> None:
        decode_rows_into(rows, values[start:stop], scales[start:stop], table)

    return chunked_matmul(x, values.shape[0], decode, scratch_dtype=torch.float32)


def mxfp4_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype, never dequantizing it whole."""
    check_mxfp4_weight(values, scales, x.shape[-1])
    out = mxfp4_matmul(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), values, scales)   # [T, N]
    return add_bias_(out, bias).to(x.dtype).view(*x.shape[:-1], values.shape[-2])


def mxfp4_swiglu(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                 w2_scale: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                 activation: ExpertActivation) -> torch.Tensor:
    """One expert: w2 @ act(w13 @ x + b13) + b2 for x [n, H] -> [n, H] in compute_dtype(x)."""
    activated = activation.on_gate_up(add_bias_(mxfp4_matmul(x, w13, w13_scale), b13))   # [n, I]
    return add_bias_(mxfp4_matmul(activated, w2, w2_scale), b2)


def mxfp4_expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, packed(H)] uint8
    w13_scale: torch.Tensor,  # [E, 2I, ceil(H / 32)] uint8
    w2: torch.Tensor,         # [E, H, packed(I)] uint8
    w2_scale: torch.Tensor,   # [E, H, ceil(I / 32)] uint8
    *,
    b13: torch.Tensor | None = None,   # [E, 2I]
    b2: torch.Tensor | None = None,    # [E, H]
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [N, H] in x_sorted.dtype, unweighted
    """expert_mlp with MXFP4 weights: busy experts only, each one's weights decoded chunk by chunk (no
    all-experts padded form: it would decode every expert, and decoding is what an MXFP4 expert costs)."""
    check_mxfp4_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale)
    ends = check_sorted_counts(x_sorted, counts, w13.shape[0])             # [E]
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    for seg in busy_segments(counts, ends):
        e = seg.expert
        out[seg.start:seg.end] = mxfp4_swiglu(x_sorted[seg.start:seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e],
                                              None if b13 is None else b13[e], None if b2 is None else b2[e],
                                              activation)
    return out


def mxfp4_masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, packed(H)] uint8
    w13_scale: torch.Tensor,  # [E, 2I, ceil(H / 32)] uint8
    w2: torch.Tensor,         # [E, H, packed(I)] uint8
    w2_scale: torch.Tensor,   # [E, H, ceil(I / 32)] uint8
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: ExpertActivation = ExpertActivation(),
) -> torch.Tensor:            # [E, M, H] in x.dtype, rows past counts[e] zero
    """masked_expert_mlp with MXFP4 weights; stale rows past counts[e] are never read (they may hold NaN)."""
    check_mxfp4_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale)
    check_masked_counts(x, counts, w13.shape[0])
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    for seg in masked_segments(counts):
        e = seg.expert
        out[e, :seg.end] = mxfp4_swiglu(x[e, :seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e],
                                        None if b13 is None else b13[e], None if b2 is None else b2[e], activation)
    return out
