"""`--gpu cpu`: this machine as the planner's hardware, from costs measured on it (once, then cached).

A spec sheet says nothing of a shared development box, so the copy bandwidth (a 256 MiB tensor copy, best
of 5) and the fp32 matmul rate (1024 x 1024, best of 5) are measured, with one thread per rank (each rank
of a job on this machine gets cores / ranks threads). A small model's decode on a CPU is bound by the
framework, not by those rates, so the runtime's own decode steps are timed too, by part, on the bench
checkpoints (bench/bench_offline.py's Qwen3-MoE, bench/bench_tp_pp.py's Llama) at batch 1 and 8, and the
collectives between two rank processes (`cpu_collectives.py`): the fixed costs the roofline adds
(`cpu_overhead_fit.py`). The cache (~/.cache/moe-runtime/cpu_calibration.json) is keyed by host and core
count; delete it (or `refresh=True`) to measure again. Without the bench modules (an installed package)
only the rates are measured and the roofline has no CPU overheads: its step times are then optimistic.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_runtime.planner.cpu_overheads import CpuOverheads
from moe_runtime.planner.hardware import Hardware

logger = logging.getLogger(__name__)

CACHE = Path.home() / ".cache" / "moe-runtime" / "cpu_calibration.json"
STEP_OVERHEAD_S = 2e-3        # without measured overheads: a step's host work


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


def measure_overheads(rates: CpuRates) -> CpuOverheads | None:
    """Decode steps of the bench checkpoints by part and two ranks' collectives, fitted (None: no bench here)."""
    try:
        from bench.bench_offline import build_checkpoint
        from bench.bench_tp_pp import build_checkpoint as build_dense
    except ImportError:
        logger.warning("cpu calibration: bench/ is not importable; no measured step overheads")
        return None
    from moe_runtime.planner.cpu_collectives import measure_collectives
    from moe_runtime.planner.cpu_overhead_fit import fit_overheads
    from moe_runtime.planner.cpu_step_costs import measure_step_parts
    from moe_runtime.planner.model_shape import load_model_shape

    moe_path, dense_path = build_checkpoint("float32"), build_dense()
    moe_parts = tuple(measure_step_parts(moe_path, b) for b in (1, 8))
    dense_parts = tuple(measure_step_parts(dense_path, b) for b in (1, 8))
    return fit_overheads(cpu_hardware(rates, overheads=None), load_model_shape(moe_path), moe_parts,
                         load_model_shape(dense_path), dense_parts, measure_collectives(), rates.cores)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cached_calibration(path: Path = CACHE, refresh: bool = False) -> tuple[CpuRates, CpuOverheads | None]:
    key = f"{platform.node()}/{os.cpu_count()}"
    stored = _read_cache(path)
    entry = stored.get(key)
    if entry is not None and not refresh:
        try:
            overheads = entry["overheads"]
            return CpuRates(**entry["rates"]), CpuOverheads.from_json(overheads) if overheads else None
        except (KeyError, TypeError, ValueError):   # written by another version: measured again below
            logger.info("cpu calibration: the cached entry of %s is not this version's; measuring again", key)
    rates = measure_rates()
    overheads = measure_overheads(rates)
    stored[key] = {"rates": asdict(rates), "overheads": overheads.as_json() if overheads else None}
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


def cached_rates(path: Path = CACHE) -> CpuRates:
    return cached_calibration(path)[0]


def cpu_hardware(rates: CpuRates | None = None, overheads: CpuOverheads | None | str = "cached") -> Hardware:
    """One "GPU" is one core (plan with --gpus-per-node = the cores): its measured single-thread rates, and
    the measured per-part, per-collective and shared-core costs (`overheads`; "cached": from the cache)."""
    if rates is None or overheads == "cached":
        cached_rates_, cached_overheads = cached_calibration()
        rates = rates or cached_rates_
        overheads = cached_overheads if overheads == "cached" else overheads
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / rates.cores
    link = overheads.all_to_all_bytes_s if overheads else 1.5e9
    latency = overheads.all_to_all_latency_s if overheads else 150e-6
    return Hardware("cpu", memory, rates.copy_bytes_s, rates.matmul_flops, 0.0, link, link,
                    fp32_flops=rates.matmul_flops, mem_efficiency=1.0, compute_efficiency=1.0, link_efficiency=1.0,
                    collective_latency_s=latency, layer_overhead_s=0.0 if overheads else 40 * rates.op_seconds,
                    step_overhead_s=STEP_OVERHEAD_S, memory_reserve=0.0, device="cpu", cpu=overheads)
