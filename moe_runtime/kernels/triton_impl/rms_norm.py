"""RMSNorm and fused residual-add + RMSNorm, one Triton program per row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rms_norm import NormOutput


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, H, eps,
                    stride_x, stride_residual, stride_out, stride_residual_out,
                    ADD_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0)  # in the input dtype
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / H
    normed = (x32 / tl.sqrt(variance + eps)).to(x_ptr.dtype.element_ty)  # HF: normalize in fp32, cast back
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def launch(x, residual, weight, eps):
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(rows) if residual is not None else rows
    res_rows = residual.reshape(-1, hidden).contiguous() if residual is not None else rows
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight.contiguous(), out, summed, hidden, float(eps),
            rows.stride(0), res_rows.stride(0), out.stride(0), summed.stride(0),
            ADD_RESIDUAL=residual is not None, BLOCK_H=triton.next_power_of_2(hidden),
        )
    return out.view(*x.shape[:-1], hidden), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> NormOutput:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    out, summed = launch(x, residual, weight, eps)
    return NormOutput(out=out, residual=summed)
