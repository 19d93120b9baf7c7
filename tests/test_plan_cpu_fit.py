"""The CPU calibration's fit inverts the roofline: steps synthesised from known costs give those costs back.

Measured steps are the bench's business (bench/bench_plan_calibration.py); here the measurements are made
by the planner's own StepModel from a known CpuOverheads (one-rank part costs, the expert-parallel cost per
MoE layer, the all-reduce cost, the control per step), so a fit that mis-attributes a part, double counts the
one-rank work in a multi-rank residual or divides by the wrong number of events gets other costs back.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.calibration.calibration_models import dense_calibration_model, moe_calibration_model
from moe_runtime.planner.calibration.cpu_calibration import CpuRates, cpu_hardware
from moe_runtime.planner.calibration.cpu_engine_collectives import EngineDecode
from moe_runtime.planner.calibration.cpu_overhead_fit import collective_line, fit_overheads
from moe_runtime.planner.cpu_overheads import CpuOverheads, Line
from moe_runtime.planner.calibration.cpu_step_costs import StepParts
from moe_runtime.planner.memory import resolve_precision
from moe_runtime.planner.model_shape import load_model_shape
from moe_runtime.planner.roofline import StepModel, Topology

TRUE = CpuOverheads(attention=Line(3e-4, 2e-5), moe=Line(1e-4, 9e-5), dense=Line(2e-4, 4e-5), rest=Line(2e-3, 1e-4),
                    expert_parallel=Line(4e-3, 5e-8), all_reduce=Line(1.5e-3, 2e-8), pipeline_hop=Line(8e-5, 2e-10),
                    control_s=3e-3, cores=2)
CONTEXT = 24.0


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The calibration models' shapes, read from their config.json (written without weights)."""
    import transformers

    out = {}
    for model in (moe_calibration_model(), dense_calibration_model()):
        config = getattr(transformers, model.config_class)(**model.shape)
        config.architectures = [model.architecture]
        path = tmp_path_factory.mktemp(model.name)
        config.to_json_file(str(path / "config.json"))
        out[model.name] = load_model_shape(path)
    return out["qwen3moe-calibration"], out["llama-calibration"]


def _model(shape, layout: ParallelLayout, hardware) -> StepModel:
    return StepModel(shape, layout, resolve_precision(shape, "float32", None), hardware, Topology(1))


def _parts(shape, hardware, batch: int) -> StepParts:
    """A one-rank step by part as the true costs make it."""
    model = _model(shape, ParallelLayout(), hardware)
    attention = moe = dense = 0.0
    for layer in shape.layers:
        attention_roof, mlp_roof = model.part_rooflines(layer, True, batch, CONTEXT, True)
        attention += attention_roof + TRUE.attention.at(batch)
        if layer.moe:
            moe += mlp_roof + TRUE.moe.at(model.touched_experts(batch))
        else:
            dense += mlp_roof + TRUE.dense.at(batch)
    rest = TRUE.rest.at(batch) + model._lm_head_seconds(batch)
    moe_layers = sum(layer.moe for layer in shape.layers)
    return StepParts(batch, CONTEXT, attention, moe, dense, rest, moe_layers, len(shape.layers) - moe_layers)


def _job(shape, hardware, layout: dict, batch: int) -> EngineDecode:
    """A multi-rank job's decode step as the true costs make it (forward without the control; wall with it)."""
    model = _model(shape, ParallelLayout(**layout), hardware)
    wall = model.step_seconds(batch, CONTEXT, decode=True)
    return EngineDecode(layout, batch, CONTEXT, wall, wall - TRUE.control_s, 0)


def test_fit_gives_back_the_costs_that_made_the_steps(shapes):
    moe, dense = shapes
    rates = cpu_hardware(CpuRates("test", 2, 2e10, 5e10, 1e-5), overheads=None)
    truth = replace(rates, cpu=TRUE)
    fitted = fit_overheads(rates, moe, (_parts(moe, truth, 1), _parts(moe, truth, 8)), dense,
                           (_parts(dense, truth, 1), _parts(dense, truth, 8)),
                           (_job(moe, truth, dict(ep=2, dp_attn=2), 1), _job(moe, truth, dict(ep=2, dp_attn=2), 8)),
                           (_job(dense, truth, dict(tp=2), 1), _job(dense, truth, dict(tp=2), 8)),
                           TRUE.pipeline_hop, cores=2)
    for name in ("attention", "moe", "dense", "rest", "expert_parallel", "all_reduce"):
        got, want = getattr(fitted, name), getattr(TRUE, name)
        assert got.fixed == pytest.approx(want.fixed, rel=1e-6, abs=1e-12), name
        assert got.per_unit == pytest.approx(want.per_unit, rel=1e-6, abs=1e-15), name
    assert fitted.control_s == pytest.approx(TRUE.control_s)
    # the fitted costs predict a held-out layout (attention TP inside an EP worker) as the true ones do
    held_out = dict(ep=2, dp_attn=1)
    predicted = _model(moe, ParallelLayout(**held_out), replace(rates, cpu=fitted)).step_seconds(4, 40.0, True)
    assert predicted == pytest.approx(_model(moe, ParallelLayout(**held_out), truth).step_seconds(4, 40.0, True))


def test_a_collective_cost_never_falls_with_its_payload():
    """Two noisy points may slope down; a collective's time does not, so its line is flat at their mean."""
    assert collective_line([(100.0, 3e-3), (800.0, 2e-3)]) == Line(2.5e-3, 0.0)
    assert collective_line([(100.0, 2e-3), (800.0, 3e-3)]).per_unit > 0
