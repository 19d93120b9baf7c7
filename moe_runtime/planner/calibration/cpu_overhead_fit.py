"""Measured decode steps minus the roofline's terms: the CPU's fixed costs per part, and what several ranks add.

One rank: for each part the measured seconds per layer at batch 1 and at batch 8 (`cpu_step_costs`) less the
part's max(compute, memory) from the measured rates (`StepModel.part_rooflines`), as a line through those
points (`cpu_overheads.Line`): attention and dense MLPs against tokens, MoE blocks against the experts the batch
touches, the rest of the step (less the LM head's roofline) against tokens.

Several ranks, from running jobs (`cpu_engine_collectives.EngineDecode`), each at two batch sizes:
  - expert parallelism (`ep=2, dp_attn=2`, MoE model): a worker's forward step less what the one-rank costs
    above predict for its share of the work, per MoE layer, against the bytes a rank sends per all-to-all;
  - tensor parallelism (`tp=2`, dense model): the same residual per all-reduce (two per layer), against the
    bytes reduced;
  - control: the front's wall time per step less the workers' forward, averaged over both jobs.
These two layouts calibrate; the others a bench compares (attention TP inside an EP worker, pipeline stages,
other batch sizes and contexts) are predicted from the parts, not fitted to.
"""
from __future__ import annotations

from dataclasses import replace

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.calibration.cpu_engine_collectives import EngineDecode
from moe_runtime.planner.cpu_overheads import CpuOverheads, Line
from moe_runtime.planner.calibration.cpu_step_costs import StepParts
from moe_runtime.planner.hardware import Hardware
from moe_runtime.planner.memory import resolve_precision
from moe_runtime.planner.model_shape import ModelShape
from moe_runtime.planner.roofline import StepModel, Topology

NO_COST = Line(0.0, 0.0)


def fit_overheads(rates_hardware: Hardware, moe: ModelShape, moe_parts: tuple[StepParts, StepParts],
                  dense: ModelShape, dense_parts: tuple[StepParts, StepParts], expert_parallel: tuple[EngineDecode, ...],
                  tensor_parallel: tuple[EngineDecode, ...], pipeline_hop: Line, cores: int) -> CpuOverheads:
    """`rates_hardware`: the CPU with its measured rates and no overheads (the roofline terms to subtract)."""
    one_rank = _fit_one_rank(replace(rates_hardware, cpu=None), moe, moe_parts, dense, dense_parts, cores)
    work_only = replace(rates_hardware, cpu=one_rank)     # one rank's costs, nothing for other ranks yet
    ep_points = [_residual_per(point, moe, work_only, _moe_layers(moe),
                               _model(moe, ParallelLayout(**point.layout), work_only).all_to_all_bytes)
                 for point in expert_parallel]
    tp_points = [_residual_per(point, dense, work_only, 2 * dense.num_layers,
                               lambda b: b * dense.hidden_size * 4) for point in tensor_parallel]
    control = [max(p.wall_s - p.forward_s, 0.0) for p in (*expert_parallel, *tensor_parallel)]
    return replace(one_rank, expert_parallel=collective_line(ep_points), all_reduce=collective_line(tp_points),
                   pipeline_hop=pipeline_hop,
                   control_s=sum(control) / len(control) if control else 0.0)


def _fit_one_rank(hw: Hardware, moe: ModelShape, moe_parts: tuple[StepParts, StepParts], dense: ModelShape,
                  dense_parts: tuple[StepParts, StepParts], cores: int) -> CpuOverheads:
    moe_model, dense_model = _model(moe, ParallelLayout(), hw), _model(dense, ParallelLayout(), hw)
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
    return CpuOverheads(lines["attention"], lines["moe"], lines["dense"], lines["rest"], NO_COST, NO_COST, NO_COST,
                        0.0, cores)


def _residual_per(point: EngineDecode, shape: ModelShape, work_only: Hardware, events: int,
                  units) -> tuple[float, float]:
    """(units at the point's batch, seconds per event): the measured forward step less one rank's predicted work."""
    model = _model(shape, ParallelLayout(**point.layout), work_only)
    predicted = model.step_seconds(point.batch_per_worker, point.context, decode=True)
    return units(point.batch_per_worker), max(point.forward_s - predicted, 0.0) / max(events, 1)


def _model(shape: ModelShape, layout: ParallelLayout, hw: Hardware) -> StepModel:
    return StepModel(shape, layout, resolve_precision(shape, "float32", None), hw, Topology(1))


def _moe_layers(shape: ModelShape) -> int:
    return sum(1 for layer in shape.layers if layer.moe)


def _line(points: list[tuple[float, float]]) -> Line:
    """The least-squares line through the points (two per model; attention and rest have both models')."""
    if not points:
        return NO_COST
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return Line(my - slope * mx, slope)


def collective_line(points: list[tuple[float, float]]) -> Line:
    """A collective's cost against its payload: the least-squares line, flat at the mean where noise slopes it
    down (a larger payload never costs less)."""
    line = _line(points)
    if line.per_unit >= 0:
        return line
    return Line(sum(y for _, y in points) / len(points), 0.0)
