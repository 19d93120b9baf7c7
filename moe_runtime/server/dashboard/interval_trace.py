"""The expert-load trace the dashboard offers for download, in `load_balancer.trace`'s JSON format.

The engine reports running totals per logical expert; each row of this trace is the difference
of two consecutive totals (tokens per expert in one sampling interval), so no token is lost
between samples even when nobody watched for a while. Intervals without tokens are skipped.
Rows are sampling intervals rather than single engine steps: `interval_times` and
`engine_steps` (format extras `load_trace` ignores) say what each row covers.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from moe_runtime.load_balancer.trace import TRACE_FORMAT, TRACE_VERSION


@dataclass
class TraceRow:
    t: float                  # unix time the interval ended
    engine_steps: int         # engine steps completed by then
    counts: torch.Tensor      # [L, E] tokens per logical expert in the interval


class IntervalTrace:
    def __init__(self, max_rows: int = 3600):
        if max_rows < 1:
            raise ValueError(f"IntervalTrace max_rows={max_rows}: must be >= 1")
        self.rows: collections.deque[TraceRow] = collections.deque(maxlen=max_rows)
        self._totals: torch.Tensor | None = None  # [L, E] at the previous sample
        self.num_slots = 0
        self.num_ranks = 0

    def add(self, t: float, snapshot) -> TraceRow | None:
        """Record the tokens routed since the previous snapshot; returns the new row, if any."""
        totals = snapshot.totals.to(torch.long).cpu()  # [L, E]
        self.num_slots = int(snapshot.placement.shape[1])
        self.num_ranks = int(snapshot.rank_load.shape[1])
        previous = self._totals
        self._totals = totals.clone()
        if previous is None or previous.shape != totals.shape or bool((totals < previous).any()):
            return None  # first sample, or an engine with other shapes / restarted totals: a new baseline
        delta = totals - previous  # [L, E]
        if not bool(delta.any()):
            return None
        row = TraceRow(t, int(snapshot.steps), delta)
        self.rows.append(row)
        return row

    def to_json(self) -> dict:
        """The trace as `load_balancer.trace.load_trace` reads it (steps [S, L, E], oldest first)."""
        num_layers, num_experts = self._totals.shape if self._totals is not None else (0, 0)
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "num_layers": int(num_layers),
            "num_experts": int(num_experts),
            "num_slots": self.num_slots,
            "num_ranks": self.num_ranks,
            "steps": [row.counts.tolist() for row in self.rows],
            "interval_times": [row.t for row in self.rows],
            "engine_steps": [row.engine_steps for row in self.rows],
            "source": "moe-serve dashboard: token counts per sampling interval (differences of running totals)",
        }
