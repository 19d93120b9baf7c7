"""What one rebalance of the expert placement did, successful or not: the one event type.

The live rebalancer makes it (merged over pipeline stages on global rank 0), the control plane
carries it to the front as it is (a dataclass of numbers and strings, which msgspec encodes field
by field), and the engines, `/metrics` and the dashboard read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class RebalanceEvent:
    index: int                      # rebalances run before this one (-1: none was run)
    trigger: str                    # "interval" | "threshold" | "manual"
    started_at: float               # unix time
    duration_s: float
    experts_moved: int              # expert weights copied into new slots
    balancedness_before: float      # mean over MoE layers, on the window the plan was made from
    balancedness_after: float       # the same load under the placement in force afterwards
    ok: bool = True
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
