"""The fixed costs a CPU decode step pays beyond its FLOPs and bytes, fitted from measured steps.

`cpu_step_costs.measure_step_parts` times the attention, MoE, dense and remaining parts of real decode steps
of one rank at two batch sizes; the roofline predicts each part's max(compute, memory) from the measured rates.
The difference is framework cost (operators, routing, the per-expert loop, sampling, scheduling), fitted per part
as a line: attention and dense MLPs in the tokens a rank runs, an MoE block in the experts its rank touches
(its loop runs once per touched expert), the rest of the step in the tokens sampled. What several ranks add is
measured in running multi-rank jobs (`cpu_engine_collectives.py`): per MoE layer of an expert-parallel step
(dispatch, combine and the waits and contention around them) against the bytes a rank sends, per tensor-parallel
all-reduce against the bytes reduced, and the front and lock-step control per step; a pipeline hop is gloo's
point to point (`cpu_pipeline_hops.py`). The roofline's CPU branch adds these (`StepModel`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
    expert_parallel: Line      # one MoE layer of an EP step beyond one rank's work, in bytes a rank sends per all-to-all
    all_reduce: Line           # one tensor-parallel all-reduce inside a running job, in bytes reduced
    pipeline_hop: Line         # one stage-to-stage send, in bytes
    control_s: float           # per multi-rank step: the front and the lock-step loop beyond the workers' forward
    cores: int

    def as_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(values: dict) -> "CpuOverheads":
        lines = {k: Line(**values[k]) for k in ("attention", "moe", "dense", "rest", "expert_parallel", "all_reduce",
                                                 "pipeline_hop")}
        return CpuOverheads(**{**values, **lines})
