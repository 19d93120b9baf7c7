"""float8_e4m3fn in Triton kernels: the native FP8 type where the target has one, its bytes
decoded (and encoded) by hand everywhere else.

Which read runs where is the kernel set's `Fp8Scheme` (fp8_scheme.py), decided once:
- native: the float8_e4m3fn tensor is loaded as such and converted with `.to(tl.float32)`. Compiled on
  NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper, Blackwell), where Triton supports fp8e4nv
  and the conversion is a hardware instruction.
- bytes: the tensor is passed as a uint8 view and `e4m3_bits_to_float` decodes each code. Used in the
  Triton interpreter (TRITON_INTERPRET=1: the CPU tests), on NVIDIA GPUs below 8.9 (Triton refuses
  fp8e4nv there) and on ROCm (whose native FP8 types are the fnuz variants, a different encoding).
  The interpreter of Triton 3.9 can load float8_e4m3fn itself, but it decodes the NaN codes 0x7F/0xFF
  as +-480, and the interpreters of older releases (pyproject allows triton >= 3.0) have no FP8 loads;
  the bytes path is exact e4m3fn on all of them. The tests run both paths in the interpreter.

`float_to_e4m3_bits` is the way back (fp32 -> e4m3fn code, rounded to nearest even as torch's
`.to(torch.float8_e4m3fn)` rounds): the FP8-activation scheme's quantizer stores its codes with it
where the dot is emulated (the interpreter); compiled on sm89+ it stores float8_e4m3fn natively.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_bits_to_float(bits):
    """uint8 e4m3fn codes -> fp32 values, exactly: sign, 4-bit exponent (bias 7), 3-bit mantissa,
    subnormals, and NaN for 0x7F/0xFF (e4m3fn has no infinities).

    Normals move the 7 payload bits under fp32's exponent and mantissa and rebias the exponent
    (7 -> 127) with one integer add; subnormals are computed as mantissa * 2^-9 in float, so no fp32
    denormal (which a GPU may flush) appears on the way.
    """
    b = bits.to(tl.int32)
    payload = b & 0x7F                                         # exponent and mantissa
    fp32_bits = (payload << 20) + (120 << 23)                  # exact for exponents 1..15
    fp32_bits = tl.where(payload == 0x7F, 0x7FC00000, fp32_bits)   # quiet NaN
    fp32_bits = fp32_bits | ((b & 0x80) << 24)                 # sign
    value = fp32_bits.to(tl.float32, bitcast=True)
    subnormal = (b & 0x7).to(tl.float32) * 0.001953125         # exponent 0: mantissa * 2^-9
    return tl.where(payload < 8, tl.where(b >= 0x80, -subnormal, subnormal), value)


@triton.jit
def fp8_tile_to_float(tile, E4M3_BYTES: tl.constexpr):
    """A loaded FP8 weight tile -> fp32: bytes decoded by hand, or the native conversion."""
    if E4M3_BYTES:
        values = e4m3_bits_to_float(tile)
    else:
        values = tile.to(tl.float32)
    return values


@triton.jit
def float_to_e4m3_bits(value):
    """fp32 values with |value| <= 448 (or NaN) -> uint8 e4m3fn codes, rounded to nearest even.

    Normals (|v| >= 2^-6) round fp32's 23 mantissa bits to 3 with one integer add (ties to even via
    the kept bit) and rebias the exponent (127 -> 7); a carry rolls into the exponent as it should.
    Subnormals are round(|v| * 2^9) in float (the 2^23 add rounds to an integer, ties to even); 8
    there is the smallest normal's code. NaN -> 0x7F with its sign. Callers clamp to +-448 first.
    """
    bits = value.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    rounded = magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)                                 # exponent bias 127 -> 7
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < 0.015625, subnormal, normal)
    code = tl.where(magnitude != magnitude, 0x7F, code)                   # NaN
    return (code | sign).to(tl.uint8)
