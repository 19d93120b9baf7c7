"""Measured decode steps minus the roofline's compute and memory terms: the CPU's fixed costs, per part.

For each part the measured seconds per layer at batch 1 and at batch 8 (`cpu_step_costs`) less the part's
max(compute, memory) from the measured rates (`StepModel.part_rooflines`), as a line through those two
points (`cpu_overheads.Line`): attention and dense MLPs against tokens, MoE blocks against the experts the
batch touches, the rest of the step (less the LM head's roofline) against tokens.
"""
from __future__ import annotations

from dataclasses import replace

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.cpu_collectives import CollectiveCosts
from moe_runtime.planner.cpu_overheads import CpuOverheads, Line
from moe_runtime.planner.cpu_step_costs import StepParts
from moe_runtime.planner.hardware import Hardware
from moe_runtime.planner.memory import resolve_precision
from moe_runtime.planner.model_shape import ModelShape
from moe_runtime.planner.roofline import StepModel, Topology


def fit_overheads(rates_hardware: Hardware, moe: ModelShape, moe_parts: tuple[StepParts, StepParts],
                  dense: ModelShape, dense_parts: tuple[StepParts, StepParts], collectives: CollectiveCosts,
                  cores: int) -> CpuOverheads:
    """`rates_hardware`: the CPU with its measured rates and no overheads (the roofline terms to subtract)."""
    hw = replace(rates_hardware, cpu=None)
    moe_model, dense_model = _one_rank(moe, hw), _one_rank(dense, hw)
    points = {"attention": [], "moe": [], "dense": [], "rest": []}
    for model, parts_pair in ((moe_model, moe_parts), (dense_model, dense_parts)):
        for parts in parts_pair:
            b, ctx = parts.batch, parts.context
            layers = model.shape.layers
            rooflines = [model.part_rooflines(layer, True, b, ctx, True) for layer in layers]
            attention_roof = sum(r[0] for r in rooflines) / len(layers)
            points["attention"].append((b, parts.attention_s / len(layers) - attention_roof))
            if parts.moe_layers:
                roof = sum(r[1] for r, layer in zip(rooflines, layers) if layer.moe) / parts.moe_layers
                points["moe"].append((model.touched_experts(b), parts.moe_s / parts.moe_layers - roof))
            if parts.dense_layers:
                roof = sum(r[1] for r, layer in zip(rooflines, layers) if not layer.moe) / parts.dense_layers
                points["dense"].append((b, parts.dense_s / parts.dense_layers - roof))
            points["rest"].append((b, parts.rest_s - model._lm_head_seconds(b)))
    lines = {kind: _line(pts) for kind, pts in points.items()}
    c = collectives
    return CpuOverheads(lines["attention"], lines["moe"], lines["dense"], lines["rest"], c.control_s,
                        c.front_round_trip_s, c.all_reduce_latency_s, c.all_reduce_bytes_s, c.all_to_all_latency_s,
                        c.all_to_all_bytes_s, c.shared_slowdown, cores)


def _one_rank(shape: ModelShape, hw: Hardware) -> StepModel:
    return StepModel(shape, ParallelLayout(), resolve_precision(shape, "float32", None), hw, Topology(1))


def _line(points: list[tuple[float, float]]) -> Line:
    """The least-squares line through the points (two per model; attention and rest have both models')."""
    if not points:
        return Line(0.0, 0.0)
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return Line(my - slope * mx, slope)
