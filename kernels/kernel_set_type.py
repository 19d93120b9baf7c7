"""The set of kernel functions one implementation family provides (the engine holds one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    name: str
    select_experts: Callable
    permute_by_expert: Callable
    expert_mlp: Callable
    masked_expert_mlp: Callable
    unpermute_reduce: Callable
    fused_moe: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    paged_decode_attention: Callable
