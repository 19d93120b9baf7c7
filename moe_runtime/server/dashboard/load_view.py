"""The expert-load part of the dashboard state: an `ExpertLoadSnapshot` as plain JSON-ready lists.

Adds what the page needs beyond `snapshot.to_dict()`: the replica count of every logical expert,
the rank of every physical slot and an estimate of each slot's tokens (a replicated expert's
tokens split evenly over its replicas, the split the runtime's replica choice makes).
"""
from __future__ import annotations

import math

import torch


def finite_or_none(values: list) -> list:
    """JSON has no NaN/inf: a layer with no defined value becomes null."""
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]


def load_view(snapshot) -> dict:
    """JSON for one snapshot: counts [L, E], rank_load [L, W], placement [L, P] and derived views."""
    counts = snapshot.counts.to(torch.long)  # [L, E]
    phy2log = snapshot.placement.to(torch.long)  # [L, P]
    num_layers, num_experts = counts.shape
    num_slots = phy2log.shape[1]
    num_ranks = snapshot.rank_load.shape[1]
    if num_slots % num_ranks:
        raise ValueError(f"expert-load snapshot: {num_slots} physical slots do not split over {num_ranks} ranks")
    slots_per_rank = num_slots // num_ranks
    replicas = torch.zeros_like(counts).scatter_add_(1, phy2log, torch.ones_like(phy2log))  # [L, E]
    per_replica = counts.double() / replicas.clamp(min=1)  # [L, E]
    slot_load = per_replica.gather(1, phy2log)  # [L, P]
    return {
        "num_layers": num_layers,
        "num_experts": num_experts,
        "num_slots": num_slots,
        "num_ranks": num_ranks,
        "slots_per_rank": slots_per_rank,
        "window": int(snapshot.window),
        "steps": int(snapshot.steps),
        "counts": counts.tolist(),
        "rank_load": snapshot.rank_load.double().tolist(),
        "balancedness": finite_or_none(snapshot.balancedness.double().tolist()),
        "max_over_mean": finite_or_none(snapshot.max_over_mean.double().tolist()),
        "placement": phy2log.tolist(),
        "replicas": replicas.tolist(),
        "slot_load": slot_load.tolist(),
        "slot_rank": [slot // slots_per_rank for slot in range(num_slots)],
    }
