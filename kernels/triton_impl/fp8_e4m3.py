"""Reading float8_e4m3fn weights in a Triton kernel: the native FP8 load where the target has one,
the raw bytes decoded by hand everywhere else.

Which path runs where (`native_fp8_loads`):
- native: the float8_e4m3fn tensor is loaded as such and converted with `.to(tl.float32)`. Compiled on
  NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper, Blackwell), where Triton supports fp8e4nv
  and the conversion is a hardware instruction.
- bytes: the tensor is passed as a uint8 view and `e4m3_bits_to_float` decodes each code. Used in the
  Triton interpreter (TRITON_INTERPRET=1: the CPU tests), on NVIDIA GPUs below 8.9 (Triton refuses
  fp8e4nv there) and on ROCm (whose native FP8 types are the fnuz variants, a different encoding).
  The interpreter of Triton 3.9 can load float8_e4m3fn itself, but it decodes the NaN codes 0x7F/0xFF
  as +-480, and the interpreters of older releases (pyproject allows triton >= 3.0) have no FP8 loads;
  the bytes path is exact e4m3fn on all of them. The tests run both paths in the interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import running_in_interpreter

NATIVE_FP8_CAPABILITY = (8, 9)   # first NVIDIA architecture with fp8e4nv in Triton


def native_fp8_loads(device: torch.device) -> bool:
    """Whether kernels on `device` load float8_e4m3fn natively (else they decode its bytes)."""
    if running_in_interpreter() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= NATIVE_FP8_CAPABILITY


def fp8_operand(weight: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel receives for an FP8 weight: itself, or its uint8 view on the bytes path."""
    return weight if native_fp8_loads(weight.device) else weight.view(torch.uint8)


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
