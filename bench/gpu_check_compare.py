"""Comparing a kernel's output with its reference under a stated tolerance, with the figures to report."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from gpu_check_kernel_shapes import Tolerance


@dataclass
class Comparison:
    tolerance: str
    violations: int          # elements outside atol + rtol * |want| (non-finite ones included)
    elements: int
    max_abs_err: float
    max_rel_err: float       # max |got - want| / max |want|
    rel_l2_err: float        # ||got - want|| / ||want||
    max_abs_want: float

    @property
    def ok(self) -> bool:
        return self.violations == 0

    def problem(self, what: str) -> str | None:
        if self.ok:
            return None
        return (f"{what}: {self.violations} of {self.elements} elements outside {self.tolerance} "
                f"(max |err| {self.max_abs_err:.3g}, max |want| {self.max_abs_want:.3g})")

    def as_details(self) -> dict:
        return asdict(self)


def compare(got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance) -> Comparison:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    got32, want32 = got.detach().float(), want.detach().to(got.device).float()
    if got32.numel() == 0:
        return Comparison(str(tolerance), 0, 0, 0.0, 0.0, 0.0, 0.0)
    diff = (got32 - want32).abs()
    outside = ~(diff <= tolerance.atol + tolerance.rtol * want32.abs())       # NaN counts as outside
    scale = float(want32.abs().max())
    max_abs = float(torch.nan_to_num(diff, nan=float("inf")).max())
    norm = float(torch.linalg.vector_norm(want32))
    return Comparison(
        tolerance=str(tolerance), violations=int(outside.sum()), elements=got32.numel(), max_abs_err=max_abs,
        max_rel_err=max_abs / scale if scale else max_abs,
        rel_l2_err=float(torch.linalg.vector_norm(torch.nan_to_num(got32 - want32, nan=float("inf")))) / norm
        if norm else 0.0,
        max_abs_want=scale,
    )
