"""The masked layout (DeepEP low-latency) as the Triton grouped GEMM tiles it: no host read, no fill.

x is [E, M, H] with expert e's first counts[e] rows valid and the rest stale (a dispatch buffer's
leftovers, possibly NaN). The GEMM's grid is fixed by the shapes alone, E * ceil(M / BLOCK_M) row
tiles: each program reads counts[e] on the device and exits when its tile starts past it, so neither
a schedule built from the counts nor a host read of them (which would stall the GPU and break CUDA
graph capture of the decode step) is needed.

Outputs: rows past counts[e] are UNDEFINED (never written: no [E*M, H] zero fill per call, about
235 MB per layer per step at DeepSeek-V3 EP32). Every consumer reads only rows < counts[e]: DeepEP's
`low_latency_combine` (and the emulation of it the tests use) gathers exactly the (expert, slot)
pairs it dispatched. The torch twins return zeros there; callers must not rely on either.

Counts are validated by shape only (a value check would be a host read): a count above M is
treated as M and a negative one as 0, inside the kernels, so a bad count can never reach memory
outside x or the output. DeepEP never produces one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class MaskedRows:
    """Expert e owns rows e*capacity .. e*capacity + counts[e] - 1 of a flattened [E * capacity, ...] tensor."""

    counts: torch.Tensor   # [E] integer, on the device: read only by the kernels
    capacity: int          # M
    block_m: int

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def tiles_per_expert(self) -> int:
        return triton.cdiv(self.capacity, self.block_m)

    @property
    def num_blocks(self) -> int:
        """Row tiles of the fixed grid (most exit at once: their rows are past the count)."""
        return self.num_experts * self.tiles_per_expert

    @property
    def num_slots(self) -> int:
        """Rows of an intermediate tensor in this layout's row order: the layout's own rows."""
        return self.num_experts * self.capacity


def check_masked_layout(x: torch.Tensor, counts: torch.Tensor, num_experts: int) -> None:
    """Validate x [E, M, H] and counts [E] by shape and dtype only: no host read (see the module docstring)."""
    if x.dim() != 3 or x.shape[0] != num_experts:
        raise ValueError(f"x must be [E={num_experts}, M, H], got shape {tuple(x.shape)}")
    if counts.shape != (num_experts,) or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"counts must be integer [E={num_experts}], got {counts.dtype} {tuple(counts.shape)}")
    if counts.device != x.device:
        raise ValueError(f"counts ({counts.device}) must be on x's device ({x.device})")
