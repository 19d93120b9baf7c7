"""Choosing the implementation family (triton / torch / reference) for a device."""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from .kernel_set_type import KernelSet

logger = logging.getLogger(__name__)

KERNEL_FAMILIES = ("triton", "torch", "cpu", "reference")
ENV_OVERRIDE = "MOE_KERNELS"


def torch_kernels() -> KernelSet:
    from .expert_mlp import expert_mlp, masked_expert_mlp
    from .fp8_block_weights import fp8_expert_mlp, fp8_linear, fp8_masked_expert_mlp
    from .fused_moe import fused_moe
    from .int4_weights import int4_expert_mlp, int4_linear, int4_masked_expert_mlp
    from .int8_weights import int8_expert_mlp, int8_linear, int8_masked_expert_mlp
    from .mxfp4_weights import mxfp4_expert_mlp, mxfp4_linear, mxfp4_masked_expert_mlp
    from .pair_experts import pair_expert_mlp
    from .paged_attention import paged_decode_attention
    from .permute import permute_by_expert
    from .rms_norm import fused_add_rms_norm, rms_norm
    from .routing import select_experts
    from .skinny_matmul import linear_rows
    from .unpermute import unpermute_reduce

    return KernelSet("torch", select_experts, permute_by_expert, expert_mlp, masked_expert_mlp, pair_expert_mlp,
                     unpermute_reduce, linear_rows, fused_moe, rms_norm, fused_add_rms_norm, paged_decode_attention,
                     fp8_linear, fp8_expert_mlp, fp8_masked_expert_mlp,
                     int8_linear, int8_expert_mlp, int8_masked_expert_mlp,
                     mxfp4_linear, mxfp4_expert_mlp, mxfp4_masked_expert_mlp,
                     int4_linear=int4_linear, int4_expert_mlp=int4_expert_mlp,
                     int4_masked_expert_mlp=int4_masked_expert_mlp)


def cpu_kernels() -> KernelSet:
    """The torch family with the compiled CPU kernels (moe_runtime/kernels/cpu_native/): routed experts (float32, bfloat16,
    int8, FP8 and int4 weights; in a captured step the unquantized ones), unquantized, int8, FP8 and int4
    projections at decode row counts. Builds the kernels here, before any step is traced, so a captured step knows
    whether it can call them; without a build the torch kernels serve (the grouped entries check again per call)."""
    from dataclasses import replace

    from .cpu_native.dense_gemv import cpu_linear_rows
    from .cpu_native.expert_kernel import (compiled_kernels_built, cpu_expert_mlp, cpu_fp8_expert_mlp,
                                           cpu_fp8_linear, cpu_int4_expert_mlp, cpu_int4_linear,
                                           cpu_int4_masked_expert_mlp, cpu_int8_expert_mlp, cpu_int8_linear,
                                           cpu_pair_expert_mlp)

    torch_family = torch_kernels()
    built = compiled_kernels_built()
    # the projections' entries call the operators inside a traced step: handed out only where they exist
    return replace(torch_family, name="cpu", expert_mlp=cpu_expert_mlp, int8_expert_mlp=cpu_int8_expert_mlp,
                   int8_linear=cpu_int8_linear if built else torch_family.int8_linear,
                   fp8_expert_mlp=cpu_fp8_expert_mlp, fp8_linear=cpu_fp8_linear if built else torch_family.fp8_linear,
                   int4_expert_mlp=cpu_int4_expert_mlp, int4_masked_expert_mlp=cpu_int4_masked_expert_mlp,
                   int4_linear=cpu_int4_linear if built else torch_family.int4_linear,
                   pair_expert_mlp=cpu_pair_expert_mlp if built else torch_family.pair_expert_mlp,
                   linear_rows=cpu_linear_rows if built else torch_family.linear_rows)


def reference_kernels() -> KernelSet:
    from . import reference
    from .pair_experts import pair_expert_mlp
    from .routing import select_experts
    from .skinny_matmul import linear_rows

    return KernelSet("reference", select_experts, reference.permute_by_expert, reference.expert_mlp,
                     reference.masked_expert_mlp, pair_expert_mlp, reference.unpermute_reduce, linear_rows, reference.fused_moe,
                     reference.rms_norm, reference.fused_add_rms_norm, reference.paged_decode_attention,
                     reference.fp8_linear, reference.fp8_expert_mlp, reference.fp8_masked_expert_mlp,
                     reference.int8_linear, reference.int8_expert_mlp, reference.int8_masked_expert_mlp,
                     reference.mxfp4_linear, reference.mxfp4_expert_mlp, reference.mxfp4_masked_expert_mlp,
                     int4_linear=reference.int4_linear, int4_expert_mlp=reference.int4_expert_mlp,
                     int4_masked_expert_mlp=reference.int4_masked_expert_mlp)


def triton_kernels() -> KernelSet:
    from .triton_impl.kernel_set import triton_kernel_set   # imports triton: only when asked for

    return triton_kernel_set()


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def log_choice_once(name: str, device: str, reason: str) -> None:
    logger.info("MoE kernels: %s on %s (%s)", name, device, reason)


def get_kernels(device: torch.device | str, prefer: str = "auto") -> KernelSet:
    """Pick the kernel family: "auto" = triton on CUDA when triton imports, else torch.

    The environment variable MOE_KERNELS (triton / torch / cpu / reference) overrides "auto" only.
    """
    device = torch.device(device)
    reason = "requested"
    if prefer == "auto" and os.environ.get(ENV_OVERRIDE):
        prefer, reason = os.environ[ENV_OVERRIDE].strip().lower(), f"{ENV_OVERRIDE} environment variable"
        if prefer not in KERNEL_FAMILIES + ("auto",):
            raise ValueError(f"{ENV_OVERRIDE}={prefer!r} is not one of {KERNEL_FAMILIES + ('auto',)}")
    if prefer == "auto":
        use_triton = device.type == "cuda" and triton_importable()
        prefer, reason = ("triton", "CUDA device with triton") if use_triton else ("torch", f"{device.type} device")
    builders = {"triton": triton_kernels, "torch": torch_kernels, "cpu": cpu_kernels, "reference": reference_kernels}
    if prefer not in builders:
        raise ValueError(f"get_kernels(prefer={prefer!r}): expected 'auto' or one of {KERNEL_FAMILIES}")
    kernels = builders[prefer]()
    log_choice_once(kernels.name, str(device), reason)
    return kernels
