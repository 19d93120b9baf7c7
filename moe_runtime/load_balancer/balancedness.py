"""How evenly a placement spreads a load over ranks.

The runtime splits a replicated expert's tokens evenly over its replicas
(see `choose_replicas`), so a slot of expert e carries load[e] / logcnt[e].
"""

from __future__ import annotations

import torch

from moe_runtime.load_balancer.placement import Placement


def check_load(load: torch.Tensor, num_experts: int | None = None, name: str = "load") -> torch.Tensor:
    """Return `load` as a CPU float64 [L, E] tensor, or raise naming what is wrong."""
    load = torch.as_tensor(load)
    if load.dim() != 2:
        raise ValueError(f"{name} must be [layers, experts], got shape {tuple(load.shape)}")
    if num_experts is not None and load.shape[1] != num_experts:
        raise ValueError(f"{name} has {load.shape[1]} experts, expected {num_experts}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all():
        raise ValueError(f"{name} holds NaN or infinite values")
    if (load < 0).any():
        raise ValueError(f"{name} holds negative values")
    return load


def rank_load(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[L, W] float64: tokens each rank computes under `placement`."""
    load = check_load(load, placement.num_experts)
    if load.shape[0] != placement.num_layers:
        raise ValueError(
            f"load has {load.shape[0]} layers, placement has {placement.num_layers}"
        )
    per_replica = load / placement.logcnt.clamp(min=1)  # [L, E]
    per_slot = per_replica.gather(1, placement.phy2log)  # [L, P]
    return placement.geometry.sum_per_rank(per_slot)  # [L, W]


def balancedness(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[L] float64: mean / max of per-rank load (1.0 = perfect, 1/W = one rank does all)."""
    per_rank = rank_load(load, placement)
    return mean_over_max(per_rank)


def max_over_mean(per_rank: torch.Tensor) -> torch.Tensor:
    """[L]: max / mean of a [L, W] per-rank load (1.0 = perfect); 1.0 for an idle layer."""
    mean = per_rank.mean(-1)
    peak = per_rank.max(-1).values
    return torch.where(mean > 0, peak / mean.clamp(min=1e-300), torch.ones_like(mean))


def mean_over_max(per_rank: torch.Tensor) -> torch.Tensor:
    """[L]: mean / max of a [L, W] per-rank load (1.0 = perfect); 1.0 for an idle layer."""
    return 1.0 / max_over_mean(per_rank)
