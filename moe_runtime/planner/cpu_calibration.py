"""`--gpu cpu`: this machine as the planner's hardware, from rates measured on it (once, then cached).

A spec sheet says nothing of a shared development box, so the copy bandwidth (a 256 MiB tensor copy, best
of 5) and the fp32 matmul rate (1024 x 1024, best of 5) are measured, with one thread per rank (each rank
of a job on this machine gets cores / ranks threads). A decode layer of a small model on a CPU is bound by
the framework's per-operator cost, so that is measured too (a layer's worth of small operators). The cache
(~/.cache/moe-runtime/cpu_calibration.json) is keyed by host and core count; delete it to measure again.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_runtime.planner.hardware import Hardware

CACHE = Path.home() / ".cache" / "moe-runtime" / "cpu_calibration.json"
OPS_PER_LAYER = 40            # torch operators one decode layer runs (norms, projections, routing, experts, adds)
GLOO_BYTES_S = 1.5e9          # loopback gloo between processes of one machine
GLOO_LATENCY_S = 150e-6


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


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cached_rates(path: Path = CACHE) -> CpuRates:
    key = f"{platform.node()}/{os.cpu_count()}"
    if path.exists():
        stored = json.loads(path.read_text())
        if key in stored:
            return CpuRates(**stored[key])
    else:
        stored = {}
    rates = measure_rates()
    stored[key] = asdict(rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1))
    return rates


def cpu_hardware(rates: CpuRates | None = None) -> Hardware:
    """One "GPU" is one core (plan with --gpus-per-node = the cores): its measured single-thread rates."""
    rates = rates or cached_rates()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / rates.cores
    return Hardware("cpu", memory, rates.copy_bytes_s, rates.matmul_flops, 0.0, GLOO_BYTES_S, GLOO_BYTES_S,
                    fp32_flops=rates.matmul_flops, mem_efficiency=1.0, compute_efficiency=1.0, link_efficiency=1.0,
                    collective_latency_s=GLOO_LATENCY_S, layer_overhead_s=OPS_PER_LAYER * rates.op_seconds,
                    step_overhead_s=2e-3, memory_reserve=0.0, device="cpu")
