"""The Triton KernelSet (imports triton)."""
from __future__ import annotations

import torch

from .. import int8_weights   # no Triton int8 kernel yet: the torch family's (see kernels/int8_weights.py)
from ..kernel_set_type import KernelSet
from . import align, fp8_block_weights, fused_moe, grouped_gemm, paged_attention, rms_norm, routing, unpermute
from .interpreter import running_in_interpreter


def triton_kernel_set() -> KernelSet:
    if not torch.cuda.is_available() and not running_in_interpreter():
        raise RuntimeError("Triton kernels need a CUDA device (or TRITON_INTERPRET=1 set before import, for tests)")
    return KernelSet(
        name="triton",
        select_experts=routing.select_experts,
        permute_by_expert=align.permute_by_expert,
        expert_mlp=grouped_gemm.expert_mlp,
        masked_expert_mlp=grouped_gemm.masked_expert_mlp,
        unpermute_reduce=unpermute.unpermute_reduce,
        fused_moe=fused_moe.fused_moe,
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        paged_decode_attention=paged_attention.paged_decode_attention,
        fp8_linear=fp8_block_weights.fp8_linear,
        fp8_expert_mlp=fp8_block_weights.fp8_expert_mlp,
        fp8_masked_expert_mlp=fp8_block_weights.fp8_masked_expert_mlp,
        int8_linear=int8_weights.int8_linear,
        int8_expert_mlp=int8_weights.int8_expert_mlp,
        int8_masked_expert_mlp=int8_weights.int8_masked_expert_mlp,
    )
