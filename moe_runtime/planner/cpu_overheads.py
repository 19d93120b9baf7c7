"""The fixed costs a CPU decode step pays beyond its FLOPs and bytes, fitted from measured steps.

`cpu_step_costs.measure_step_parts` times the attention, MoE, dense and remaining parts of real decode steps
at two batch sizes; the roofline predicts each part's max(compute, memory) from the measured rates. The
difference is framework cost (operators, routing, the per-expert loop, sampling, scheduling), fitted per part
as a line: attention and dense MLPs in the tokens a rank runs, an MoE block in the experts its rank touches
(its loop runs once per touched expert), the rest of the step in the tokens sampled. Multi-rank steps add the
measured collective and control costs (`cpu_collectives.py`), and every rank runs `shared_slowdown` slower
when the ranks share the machine's cores. The roofline's CPU branch adds these (`StepModel`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """seconds = fixed + per_unit * units, never negative."""

    fixed: float
    per_unit: float

    def at(self, units: float) -> float:
        return max(self.fixed + self.per_unit * units, 0.0)


@dataclass(frozen=True)
class CpuOverheads:
    attention: Line            # one attention layer, in tokens per rank
    moe: Line                  # one MoE block, in experts its rank touches
    dense: Line                # one dense MLP, in tokens per rank
    rest: Line                 # a step's embedding, final norm, sampling, scheduling (LM head's roofline apart)
    control_s: float           # per multi-rank step: the lock-step all-reduce ...
    front_round_trip_s: float  # ... and the front's messages
    all_reduce_latency_s: float
    all_reduce_bytes_s: float
    all_to_all_latency_s: float
    all_to_all_bytes_s: float
    shared_slowdown: float     # a rank's compute when the ranks compute at once, over alone
    cores: int

    def slowdown(self, world_size: int) -> float:
        """Ranks of one job share this machine's cores (and the front's): measured with two ranks, 1 alone."""
        return self.shared_slowdown if world_size > 1 else 1.0

    def as_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    @staticmethod
    def from_json(values: dict) -> "CpuOverheads":
        lines = {k: Line(**values[k]) for k in ("attention", "moe", "dense", "rest")}
        return CpuOverheads(**{**values, **lines})
