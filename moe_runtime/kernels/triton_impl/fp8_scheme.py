"""How the Triton grouped GEMM multiplies FP8 weights: chosen once, when the kernel set is built.

Two schemes:
- dequantize (weight-only FP8): each weight tile is read as FP8, decoded to fp32, multiplied by its
  block scale and cast to the activations' dtype for a bf16 / fp16 / fp32 `tl.dot`. Runs anywhere.
- FP8 activations (DeepGEMM's scheme): the activations entering each projection are quantized per
  token and 128-column group (1x128, float32 scales amax / 448: moe_runtime/dispatch/fp8_activations.py's
  rule), the weights keep their block scales, and each K tile is one fp8 x fp8 dot accumulated in
  fp32 and multiplied by a_scale[m, k-group] * w_scale[n, k-block] before it joins the fp32 sum.
  Twice the tensor-core rate of bf16 on Hopper and half the activation bytes; the price is the
  activations' own rounding (3 mantissa bits per entry, per-group scales).

`device_fp8_scheme` picks FP8 activations on NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper,
Blackwell: Triton's fp8e4nv loads and dots) and the dequantize path everywhere else (older NVIDIA
GPUs, ROCm's fnuz FP8, the Triton interpreter). Within the FP8-activation scheme a weight whose
column block does not fit the tile (`Fp8Scheme.dot_block_k` is None: no power of two >= 32 divides
both 128 and block_k) keeps the dequantize path: a fixed property of the weight, not of the call.

The interpreter cannot run an fp8 `tl.dot`, so `native_dot=False` gives the same scheme with the
dot emulated: the quantized activations are stored as e4m3 bytes (encoded by hand, fp8_e4m3.py),
both fp8 tiles are decoded to fp32 (exact) and multiplied in ieee fp32, then scaled per k-block.
The quantization, the scales and the per-k-block accumulation are the GPU's; only the dot's
internal precision differs (Hopper's fp8 MMA accumulates with fewer bits inside one K tile).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .interpreter import running_in_interpreter

NATIVE_FP8_CAPABILITY = (8, 9)   # first NVIDIA architecture with fp8e4nv loads and dots in Triton
ACTIVATION_GROUP = 128           # columns per activation scale: DeepEP's / DeepGEMM's 1x128 (dispatch.fp8_activations)
MIN_FP8_DOT_K = 32               # an 8-bit MMA's K (Ada mma.sync k32, Hopper wgmma k32)


@dataclass(frozen=True)
class Fp8Scheme:
    native_loads: bool            # weights read as float8_e4m3fn (sm89+) or as uint8 bytes decoded by hand
    fp8_activations: bool = False  # DeepGEMM's scheme (module docstring); False: the dequantize path
    native_dot: bool = False       # with fp8_activations: fp8 x fp8 tl.dot (sm89+) or decoded to fp32 (interpreter)

    def __post_init__(self):
        if self.native_dot and not (self.fp8_activations and self.native_loads):
            raise ValueError("Fp8Scheme: a native fp8 dot needs FP8 activations and native FP8 weight loads")

    def weight_operand(self, weight: torch.Tensor) -> torch.Tensor:
        """The tensor a kernel receives for an FP8 weight: itself, or its uint8 view for the bytes read."""
        return weight if self.native_loads else weight.view(torch.uint8)

    def activation_dtype(self) -> torch.dtype:
        """How quantized activations are stored: float8_e4m3fn for a native dot, else their e4m3 bytes."""
        return torch.float8_e4m3fn if self.native_dot else torch.uint8

    def dot_block_k(self, k_dim: int, block_k: int) -> int | None:
        """BLOCK_K of the FP8-activation GEMM for a weight with `block_k`-column scale blocks, or None
        where that scheme does not apply (then the dequantize path runs): a tile must sit inside one
        activation group and one weight block, and be at least an 8-bit MMA's K."""
        if not self.fp8_activations:
            return None
        common = math.gcd(ACTIVATION_GROUP, block_k)                      # a power of two (128 is)
        if common < MIN_FP8_DOT_K:
            return None
        return min(common, max(MIN_FP8_DOT_K, 1 << max(k_dim - 1, 0).bit_length()))


def device_fp8_scheme() -> Fp8Scheme:
    """The scheme for this process's CUDA device (the current one), or the dequantize path off CUDA.

    Decided once per kernel set: a process drives one GPU model, and the decision must not cost a
    capability query per call.
    """
    if running_in_interpreter() or not torch.cuda.is_available() or torch.version.hip is not None:
        return Fp8Scheme(native_loads=False)
    native = torch.cuda.get_device_capability() >= NATIVE_FP8_CAPABILITY
    return Fp8Scheme(native_loads=native, fp8_activations=native, native_dot=native)
