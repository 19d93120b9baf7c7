"""One expert-load snapshot over all MoE layers from the pipeline stages' snapshots."""
from __future__ import annotations

import dataclasses

import torch

from moe_runtime.load_balancer.recorder import ExpertLoadSnapshot


def merge_stage_snapshots(snapshots: list[ExpertLoadSnapshot | None]) -> ExpertLoadSnapshot | None:
    """Stage order = layer order; a stage without MoE layers reports None."""
    present = [s for s in snapshots if s is not None]
    if len(present) <= 1:
        return present[0] if present else None
    joined = {name: torch.cat([getattr(s, name) for s in present]) for name in
              ("counts", "totals", "rank_load", "balancedness", "max_over_mean", "placement")}
    return dataclasses.replace(present[0], **joined)
