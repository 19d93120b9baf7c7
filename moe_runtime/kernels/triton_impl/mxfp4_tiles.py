"""MXFP4 weight tiles in Triton: packed e2m1 codes and e8m0 exponents decoded in registers.

The grouped GEMM (grouped_gemm.load_weight_tile) loads, for each column k of a BLOCK_K tile, the byte
k // 2 and the exponent k // 32 of its row, and calls `mxfp4_tile_to_float`. The decode is integer
arithmetic and one bitcast, no table in memory: an e2m1 code s.ee.m is (1 + m/2) * 2^(ee - 1) for
ee > 0 and m/2 for ee = 0, and 2^(scale - 127) is the fp32 whose exponent field is the scale byte.
Both are exact, so the tile equals moe_runtime/kernels/mxfp4_weights.py's decode bit for bit (the same values the
torch twin and the checkpoint reader produce).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_to_float(code):
    """int32 e2m1 codes (0..15) -> fp32 values, exactly."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * (1 << (tl.maximum(exponent, 1) - 1)).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def e8m0_to_float(scale):
    """uint8 e8m0 exponents -> fp32 2^(scale - 127): the byte placed in fp32's exponent field (0 gives the
    subnormal 2^-127, 255 NaN), as moe_runtime/kernels/mxfp4_weights.e8m0_to_float."""
    s = scale.to(tl.int32)
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile_to_float(packed, high_nibble, exponents):
    """A [BK, BN] tile: bytes `packed` (each column's byte), `high_nibble` 1 where the column is the byte's
    odd one, `exponents` its block's e8m0 byte -> fp32 values."""
    code = (packed.to(tl.int32) >> (high_nibble * 4)) & 0xF
    return e2m1_to_float(code) * e8m0_to_float(exponents)
