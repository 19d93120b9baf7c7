"""`--gpu cpu`: this machine as the planner's hardware, from costs measured on it (once, then cached).

A spec sheet says nothing of a shared development box, so the copy bandwidth (a 256 MiB tensor copy, best
of 5) and the fp32 matmul rate (1024 x 1024, best of 5) are measured, with one thread per rank (each rank
of a job on this machine gets cores / ranks threads). A small model's decode on a CPU is bound by the
framework, not by those rates, so the runtime's own decode steps are timed too on two small checkpoints
(`calibration_models.py`): one rank by part at batch 1 and 8 (`cpu_step_costs.py`), two-rank expert- and
tensor-parallel jobs at the same batches (`cpu_engine_collectives.py`) and gloo's pipeline hop
(`cpu_pipeline_hops.py`): the costs the roofline adds (`cpu_overhead_fit.py`). About a minute on two cores.
The cache (~/.cache/moe-runtime/cpu_calibration.json, the checkpoints beside it) is keyed by host and core
count; delete it (or `refresh=True`) to measure again.

Measuring runs extra engines on every core, so it happens only when asked (`moe-serve plan --gpu cpu
--calibrate`, the calibration bench): planning for `cpu` (the CLI, the dashboard's plan view on a serving
machine) reads the cache and, without one, raises `CpuNotCalibratedError` naming that command.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_runtime.errors import MoERuntimeError
from moe_runtime.planner.cpu_overheads import CpuOverheads
from moe_runtime.planner.hardware import Hardware
from moe_runtime.planner.model_shape import load_model_shape

logger = logging.getLogger(__name__)

CACHE = Path.home() / ".cache" / "moe-runtime" / "cpu_calibration.json"
CHECKPOINTS = Path.home() / ".cache" / "moe-runtime" / "calibration"
CALIBRATION_BATCHES = (1, 8)    # decoding requests per DP worker of each timed job
STEP_OVERHEAD_S = 2e-3        # without measured overheads: a step's host work
CALIBRATE_COMMAND = "moe-serve plan --gpu cpu --calibrate"


class CpuNotCalibratedError(MoERuntimeError):
    """Planning for `cpu` on a machine whose costs were never measured (nothing measures implicitly)."""

    def __init__(self, path: Path):
        super().__init__(f"this machine's CPU costs are not calibrated ({path} has no entry for "
                         f"{calibration_key()}): run `{CALIBRATE_COMMAND}` (about a minute on two cores; "
                         "it runs engines on every core, so not while serving)")


@dataclass(frozen=True)
class CpuRates:
    host: str
    cores: int
    copy_bytes_s: float
    matmul_flops: float
    op_seconds: float


def measure_rates() -> CpuRates:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(64 * 2**20)
        dst = torch.empty_like(src)
        copy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        matmul = min(_timed(lambda: a @ b) for _ in range(5))
        x = torch.randn(1, 512)
        w = torch.randn(512, 512)
        op = min(_timed(lambda: [x @ w for _ in range(100)]) for _ in range(5)) / 100
    finally:
        torch.set_num_threads(threads)
    return CpuRates(platform.node(), os.cpu_count() or 1, 2 * src.numel() * 4 / copy, 2 * 1024**3 / matmul, op)


def measure_overheads(rates: CpuRates, checkpoints: Path = CHECKPOINTS) -> CpuOverheads:
    """Decode steps of the calibration checkpoints: one rank by part, then two-rank EP and TP jobs, fitted."""
    # the measuring half of the planner imports torch and the engine; planning from a cache or a GPU table must not
    from moe_runtime.planner.calibration.calibration_models import dense_calibration_model, moe_calibration_model
    from moe_runtime.planner.calibration.cpu_engine_collectives import measure_engine_decode
    from moe_runtime.planner.calibration.cpu_overhead_fit import fit_overheads
    from moe_runtime.planner.calibration.cpu_pipeline_hops import measure_pipeline_hop
    from moe_runtime.planner.calibration.cpu_step_costs import measure_step_parts

    moe_path = moe_calibration_model().build(checkpoints)
    dense_path = dense_calibration_model().build(checkpoints)
    moe_parts = tuple(measure_step_parts(moe_path, b) for b in CALIBRATION_BATCHES)
    dense_parts = tuple(measure_step_parts(dense_path, b) for b in CALIBRATION_BATCHES)
    expert_parallel = tuple(measure_engine_decode(moe_path, dict(ep=2, dp_attn=2), b) for b in CALIBRATION_BATCHES)
    tensor_parallel = tuple(measure_engine_decode(dense_path, dict(tp=2), b) for b in CALIBRATION_BATCHES)
    return fit_overheads(cpu_hardware(rates, overheads=None), load_model_shape(moe_path), moe_parts,
                         load_model_shape(dense_path), dense_parts, expert_parallel, tensor_parallel,
                         measure_pipeline_hop(), rates.cores)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def calibration_key() -> str:
    return f"{platform.node()}/{os.cpu_count()}"


def recorded_calibration(path: Path = CACHE) -> tuple[CpuRates, CpuOverheads | None] | None:
    """This machine's cached calibration, or None (missing, or written by another version); never measures."""
    entry = _read_cache(path).get(calibration_key())
    if entry is None:
        return None
    try:
        overheads = entry["overheads"]
        return CpuRates(**entry["rates"]), CpuOverheads.from_json(overheads) if overheads else None
    except (KeyError, TypeError, ValueError):
        logger.info("cpu calibration: the cached entry of %s is not this version's", calibration_key())
        return None


def cached_calibration(path: Path = CACHE, refresh: bool = False) -> tuple[CpuRates, CpuOverheads | None]:
    """The cached calibration, measured first when there is none (or `refresh`): only for an explicit ask."""
    recorded = None if refresh else recorded_calibration(path)
    if recorded is not None:
        return recorded
    stored = _read_cache(path)
    rates = measure_rates()
    overheads = measure_overheads(rates)
    stored[calibration_key()] = {"rates": asdict(rates), "overheads": overheads.as_json() if overheads else None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1))
    return rates, overheads


def _read_cache(path: Path) -> dict:
    """The cache file's entries by host ({} when missing or unreadable: it is only a cache)."""
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def cpu_hardware(rates: CpuRates | None = None, overheads: CpuOverheads | None | str = "cached",
                 path: Path = CACHE) -> Hardware:
    """One "GPU" is one core (plan with --gpus-per-node = the cores): its measured single-thread rates, and
    the measured per-part, per-collective and shared-core costs (`overheads`; "cached": from the cache).
    What is taken from the cache must be there: CpuNotCalibratedError otherwise (this never measures)."""
    if rates is None or overheads == "cached":
        recorded = recorded_calibration(path)
        if recorded is None:
            raise CpuNotCalibratedError(path)
        cached_rates_, cached_overheads = recorded
        rates = rates or cached_rates_
        overheads = cached_overheads if overheads == "cached" else overheads
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / rates.cores
    hop = overheads.pipeline_hop if overheads else None
    link = 1 / hop.per_unit if hop and hop.per_unit > 0 else 1.5e9
    latency = hop.fixed if hop else 150e-6
    return Hardware("cpu", memory, rates.copy_bytes_s, rates.matmul_flops, 0.0, link, link,
                    fp32_flops=rates.matmul_flops, mem_efficiency=1.0, compute_efficiency=1.0, link_efficiency=1.0,
                    collective_latency_s=latency, layer_overhead_s=0.0 if overheads else 40 * rates.op_seconds,
                    step_overhead_s=STEP_OVERHEAD_S, memory_reserve=0.0, device="cpu", cpu=overheads)
