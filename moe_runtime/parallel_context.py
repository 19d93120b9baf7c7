"""Explicit parallel state, built once per worker and passed down (no globals)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the job.

    world = ep ranks (x pp stages). Each DP attention worker spans `attn_tp_size` ranks that split
    attention heads; the EP group spans every rank of a pipeline stage.
    """

    world_size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_tp_group: Any = None
    pp_size: int = 1
    pp_rank: int = 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        return cls(device=torch.device(device))
