"""The Triton KernelSet (imports triton).

The FP8 fields are bound to one `Fp8Scheme` (fp8_scheme.py), decided here once: FP8 activations on
sm89+ GPUs, the dequantize path elsewhere; tests pass a scheme to run the other one.
"""
from __future__ import annotations

import torch

from .. import int4_weights   # no Triton int4 kernel yet: the torch family's (see moe_runtime/kernels/int4_weights.py)
from .. import int8_weights   # no Triton int8 kernel yet: the torch family's (see moe_runtime/kernels/int8_weights.py)
from ..pair_experts import pair_expert_mlp   # a captured step's experts: inductor writes the Triton kernel
from ..skinny_matmul import linear_rows
from ..kernel_set_type import KernelSet
from . import align, fused_moe, grouped_gemm, mxfp4_weights, paged_attention, rms_norm, routing, unpermute
from .fp8_block_weights import Fp8Kernels
from .fp8_scheme import Fp8Scheme, device_fp8_scheme
from .interpreter import running_in_interpreter


def triton_kernel_set(fp8_scheme: Fp8Scheme | None = None) -> KernelSet:
    """The Triton family; FP8 weights multiplied per `fp8_scheme`, by default the current device's."""
    if not torch.cuda.is_available() and not running_in_interpreter():
        raise RuntimeError("Triton kernels need a CUDA device (or TRITON_INTERPRET=1 set before import, for tests)")
    fp8 = Fp8Kernels(fp8_scheme or device_fp8_scheme())
    return KernelSet(
        name="triton",
        select_experts=routing.select_experts,
        permute_by_expert=align.permute_by_expert,
        expert_mlp=grouped_gemm.expert_mlp,
        masked_expert_mlp=grouped_gemm.masked_expert_mlp,
        pair_expert_mlp=pair_expert_mlp,
        unpermute_reduce=unpermute.unpermute_reduce,
        linear_rows=linear_rows,
        fused_moe=fused_moe.fused_moe,
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        paged_decode_attention=paged_attention.paged_decode_attention,
        fp8_linear=fp8.linear,
        fp8_expert_mlp=fp8.expert_mlp,
        fp8_masked_expert_mlp=fp8.masked_expert_mlp,
        int8_linear=int8_weights.int8_linear,
        int8_expert_mlp=int8_weights.int8_expert_mlp,
        int8_masked_expert_mlp=int8_weights.int8_masked_expert_mlp,
        mxfp4_linear=mxfp4_weights.mxfp4_linear,
        mxfp4_expert_mlp=mxfp4_weights.mxfp4_expert_mlp,
        mxfp4_masked_expert_mlp=mxfp4_weights.mxfp4_masked_expert_mlp,
        int4_linear=int4_weights.int4_linear,
        int4_expert_mlp=int4_weights.int4_expert_mlp,
        int4_masked_expert_mlp=int4_weights.int4_masked_expert_mlp,
    )
