"""FP8 block-scaled weights kept in FP8: dequantized one row chunk at a time (the torch family).

Layout (the runtime's only FP8 weight layout): `weight` float8_e4m3fn [..., N, K] and ROW-EXPANDED
block scales `scale` float32 [..., N, ceil(K / block_k)]; scale[n, j] multiplies
weight[n, j*block_k : (j+1)*block_k] (the last column block may be partial). Dequantized weight =
weight.float() * scale.repeat_interleave(block_k, -1)[..., :K].

Memory: the point of FP8 weights is to never hold the dequantized weight, so every matmul here
dequantizes at most CHUNK_BYTES (2 MiB) of fp32 weight at a time, into one scratch buffer, and
multiplies it into the output before decoding the next rows. The chunk stays in cache between its
decode and its matmul; on the dev machine (1 MiB L2 per core, 32 MiB L3) chunks of 1, 2, 4 and 8 MiB
timed within noise of each other on a 4096 x 2048 weight at T = 1 and 16, and 2 MiB amortises the
dozen small ops each chunk costs while keeping the scratch small.

Compute dtype: on CPU the chunk is multiplied in fp32 whatever the activations' dtype. Decoding
yields fp32 anyway, CPU BLAS without bf16 hardware multiplies bf16 slower than fp32 (2-3x at T = 16
on the dev machine), and fp32 keeps the dequantized weight exact, so bf16 / fp16 outputs are the
exact result rounded once. Elsewhere (a GPU without Triton) the chunk is cast to the activations'
dtype. Outputs are in the activations' dtype.

Decoding speed on CPU: torch's float8_e4m3fn -> float conversion is a scalar loop. But the 7 payload
bits of an e4m3fn byte moved to the top of an fp32 word (its sign to the sign bit) ARE the value
times 2^-120, subnormals included (they land on fp32 subnormals). So a sign-extending int8 -> int32
copy, a shift (an in-place integer multiply: torch's in-place shift copies), a mask and a multiply
by scale * 2^120 decode a chunk bit-identically to the plain formula, in vectorised passes: 8x
faster (fp8_linear, 4096 x 2048 weight, T = 1, one thread: 7.9 ms against 63 ms). Where that trick
would be wrong the chunk takes torch's conversion instead: NaN codes (0x7F/0xFF) would decode as
+-480 (two byte-max reductions spot them); scales >= 2^8 would overflow scale * 2^120 (a real
checkpoint's scales are block amax / 448); and with denormals flushed (torch.set_flush_denormal)
FP8 subnormals would read as zero.
"""
from __future__ import annotations

import math

import torch

from .expert_mlp import (busy_segments, check_expert_weights, check_masked_counts, check_sorted_counts,
                         masked_segments, silu_and_mul)
from .chunked_weights import chunked_matmul, rows_per_chunk

FP8_DTYPE = torch.float8_e4m3fn
E4M3_PAYLOAD_SHIFT = 20                # e4m3's 3 mantissa bits to the top of fp32's 23
E4M3_SIGN_AND_PAYLOAD = 0x87F00000 - (1 << 32)   # as int32: the sign bit and the 7 shifted payload bits
E4M3_EXPONENT_GAP = 2.0 ** 120         # fp32 exponent bias 127 minus e4m3's 7
FAST_SCALE_LIMIT = 2.0 ** 8            # scale * 2^120 stays finite below this


def scale_columns(in_features: int, block_k: int) -> int:
    return -(-in_features // block_k)


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block_k: int, name: str = "weight") -> None:
    """Validate one FP8 weight [..., N, K] and its row-expanded scales [..., N, ceil(K / block_k)]."""
    if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k <= 0:
        raise ValueError(f"block_k must be a positive int, got {block_k!r}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be {FP8_DTYPE}, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{name} must be [..., N, K], got shape {tuple(weight.shape)}")
    expected = (*weight.shape[:-1], scale_columns(weight.shape[-1], block_k))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(f"{name}_scale must be float32 {expected} (row-expanded scales of {block_k}-column "
                         f"blocks for {name} {tuple(weight.shape)}), got {scale.dtype} {tuple(scale.shape)}")


def check_fp8_expert_weights(hidden: int, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                             w2_scale: torch.Tensor, block_k: int) -> int:
    """Validate FP8 `w13 [E, 2I, H]` / `w2 [E, H, I]` and their scales; return I."""
    intermediate = check_expert_weights(hidden, w13, w2)
    check_fp8_weight(w13, w13_scale, block_k, "w13")
    check_fp8_weight(w2, w2_scale, block_k, "w2")
    return intermediate


def denormals_survive(device: torch.device) -> bool:
    """False when this thread flushes fp32 denormals (torch.set_flush_denormal), which the bit decode needs."""
    tiny = torch.tensor(2.0 ** -140, device=device)
    return bool(tiny * 2.0 ** 20 != 0)


def bit_decode_applies(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the whole weight may take the CPU bit decode (NaN codes are checked per chunk)."""
    if weight.device.type != "cpu" or weight.numel() == 0:
        return False
    return bool((scale.abs() < FAST_SCALE_LIMIT).all()) and denormals_survive(weight.device)


def bit_decode_suits(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the CPU bit decode suits this weight whatever the thread: a CPU weight, its scales small enough,
    no NaN code anywhere. Fixed properties of the weight, asked once at load (`Fp8InMemory.plan`), so that a
    layer's forward reads neither its scales nor its bytes to decide (`fp8_linear_prechecked`)."""
    return (weight.device.type == "cpu" and weight.numel() > 0 and bool((scale.abs() < FAST_SCALE_LIMIT).all())
            and not holds_nan_codes(weight))


def holds_nan_codes(weight: torch.Tensor) -> bool:
    """Whether a non-empty FP8 tensor holds a NaN code (0x7F or 0xFF): two max reductions over its bytes.

    0x7F is the largest int8 and 0xFF the largest uint8, so no elementwise pass is needed.
    """
    return int(weight.view(torch.int8).max()) == 0x7F or int(weight.view(torch.uint8).max()) == 0xFF


def apply_block_scales_(values: torch.Tensor, scale: torch.Tensor, block_k: int) -> None:
    """values [R, K] *= scale [R, Kb] repeated block_k times along K (the last block may be partial)."""
    full_blocks = values.shape[1] // block_k
    full = full_blocks * block_k
    if full_blocks:
        values[:, :full].unflatten(1, (full_blocks, block_k)).mul_(scale[:, :full_blocks, None])  # [R, Kb', bk]
    if full < values.shape[1]:
        values[:, full:].mul_(scale[:, full_blocks:])


def decode_rows_into(out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                     bit_decode: bool, nan_free: bool = False) -> None:
    """out [R, K] fp32 (contiguous) = weight [R, K] fp8 dequantized with scale [R, Kb] (`nan_free`: the whole
    weight is known to hold no NaN code, so the rows are not searched for one)."""
    if bit_decode and (nan_free or not holds_nan_codes(weight)):
        bits = out.view(torch.int32)
        bits.copy_(weight.view(torch.int8))                                # sign-extends the byte
        bits.mul_(1 << E4M3_PAYLOAD_SHIFT).bitwise_and_(E4M3_SIGN_AND_PAYLOAD)  # value * 2^-120
        apply_block_scales_(out, scale * E4M3_EXPONENT_GAP, block_k)
        return
    out.copy_(weight)
    apply_block_scales_(out, scale, block_k)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole dequantized weight [..., N, K] in `dtype` (for loading and tests: matmuls use fp8_linear)."""
    check_fp8_weight(weight, scale, block_k)
    in_features = weight.shape[-1]
    rows = weight.flatten(0, -2)                                           # [R, K]
    row_scales = scale.flatten(0, -2)                                      # [R, Kb]
    out = torch.empty(rows.shape, dtype=dtype, device=weight.device)       # [R, K]
    bit_decode = bit_decode_applies(weight, scale)
    chunk = rows_per_chunk(in_features)
    scratch = None if dtype == torch.float32 else torch.empty(min(chunk, rows.shape[0]), in_features,
                                                              device=weight.device)
    for start in range(0, rows.shape[0], chunk):
        stop = min(start + chunk, rows.shape[0])
        target = out[start:stop] if scratch is None else scratch[:stop - start]
        decode_rows_into(target, rows[start:stop], row_scales[start:stop], block_k, bit_decode)
        if scratch is not None:
            out[start:stop].copy_(target)
    return out.view(weight.shape)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               suits: bool | None = None) -> torch.Tensor:
    """x [T, K] @ dequantized(weight [N, K]).T -> [T, N] in compute_dtype(x), CHUNK_BYTES of weight at a time.
    `suits`: `bit_decode_suits(weight, scale)` when known (from load); None: asked here, NaN codes per chunk."""
    if suits is None:
        bit_decode, nan_free = bit_decode_applies(weight, scale), False
    else:
        bit_decode, nan_free = suits and denormals_survive(weight.device), True

    def decode(rows: torch.Tensor, start: int, stop: int) -> None:
        decode_rows_into(rows, weight[start:stop], scale[start:stop], block_k, bit_decode, nan_free)

    return chunked_matmul(x, weight.shape[0], decode, scratch_dtype=torch.float32)


def check_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> None:
    """Validate fp8_linear's arguments: the weight [N, K] with its scales, and x [..., K]."""
    check_fp8_weight(weight, scale, block_k)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] and [N, K]")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., K], dequantized weight [N, K], bias) -> [..., N] in x.dtype, never dequantizing it whole."""
    check_fp8_linear(x, weight, scale, block_k)
    return fp8_linear_prechecked(x, weight, scale, block_k, bias)


def fp8_linear_prechecked(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                          bias: torch.Tensor | None = None, bit_decode_suits: bool | None = None) -> torch.Tensor:
    """`fp8_linear` for a weight whose fixed properties (dtype, shapes, block size, scale layout, and with
    `bit_decode_suits` whether the CPU bit decode suits it) were checked once, at load (`Fp8InMemory` does, and
    its layers' parameters do not change after it): a layer's forward pays none of those checks. x's last dim
    still has to be K (torch's matmul says so)."""
    out = fp8_matmul(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), weight, scale, block_k,
                     bit_decode_suits)                                                                # [T, N]
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_swiglu(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
               w2_scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """One expert: w2 @ (silu(gate) * up) for x [n, H], w13 [2I, H], w2 [H, I] -> [n, H] in compute_dtype(x)."""
    activated = silu_and_mul(fp8_matmul(x, w13, w13_scale, block_k))      # [n, I]
    return fp8_matmul(activated, w2, w2_scale, block_k)


def fp8_expert_mlp(
    x_sorted: torch.Tensor,   # [N, H] rows grouped by expert in contiguous segments
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, 2I, ceil(H / block_k)] float32
    w2: torch.Tensor,         # [E, H, I] float8_e4m3fn
    w2_scale: torch.Tensor,   # [E, H, ceil(I / block_k)] float32
    block_k: int,
) -> torch.Tensor:            # [N, H] in x_sorted.dtype, unweighted
    """expert_mlp with FP8 weights: busy experts only, each one's weights decoded chunk by chunk.

    No all-experts padded form here (unlike expert_mlp): it would decode every expert's weights,
    and decoding, not the Python loop, is what an FP8 expert costs on CPU.
    """
    check_fp8_expert_weights(x_sorted.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
    ends = check_sorted_counts(x_sorted, counts, w13.shape[0])             # [E]
    out = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)  # [N, H]
    for seg in busy_segments(counts, ends):
        e = seg.expert
        out[seg.start:seg.end] = fp8_swiglu(x_sorted[seg.start:seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e],
                                            block_k)
    return out


def fp8_masked_expert_mlp(
    x: torch.Tensor,          # [E, M, H]: expert e's first counts[e] rows are valid
    counts: torch.Tensor,     # [E] int64
    w13: torch.Tensor,        # [E, 2I, H] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, 2I, ceil(H / block_k)] float32
    w2: torch.Tensor,         # [E, H, I] float8_e4m3fn
    w2_scale: torch.Tensor,   # [E, H, ceil(I / block_k)] float32
    block_k: int,
) -> torch.Tensor:            # [E, M, H] in x.dtype, rows past counts[e] zero
    """masked_expert_mlp with FP8 weights; stale rows past counts[e] are never read (they may hold NaN)."""
    check_fp8_expert_weights(x.shape[-1], w13, w13_scale, w2, w2_scale, block_k)
    check_masked_counts(x, counts, w13.shape[0])
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[1], dtype=x.dtype, device=x.device)  # [E, M, H]
    for seg in masked_segments(counts):
        e = seg.expert
        out[e, :seg.end] = fp8_swiglu(x[e, :seg.end], w13[e], w13_scale[e], w2[e], w2_scale[e], block_k)
    return out
