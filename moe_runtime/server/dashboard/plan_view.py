"""The dashboard's "plan" view: `moe-serve plan` for the model being served, on the hardware it runs on.

Whoever watches a running engine asks next whether its layout is the right one: this answers with the
planner's ranked table for the served checkpoint (its config, dtype and quantization), by default on this
server's hardware (`cpu` when it runs on the CPU, the GPU table's entry matching the CUDA device's name
otherwise) and with as many GPUs per node as it sees; query parameters pick another GPU kind, counts and
workload. The served layout's row is marked, so the page can say where the running layout ranks.

The view never measures: on a CPU server it plans from the cached calibration, and without one it plans for
a GPU table (`UNCALIBRATED_FALLBACK_GPU`) and says how to calibrate (an explicit command, run while the
machine is not serving): measuring runs extra engines on the cores that serve.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Callable

from moe_runtime.errors import InvalidRequestError
from moe_runtime.planner.calibration.cpu_calibration import CpuNotCalibratedError, cpu_hardware
from moe_runtime.planner.hardware import Hardware, known_gpus, resolve_hardware
from moe_runtime.planner.memory import resolve_precision
from moe_runtime.planner.model_shape import load_model_shape
from moe_runtime.planner.plan import PlanRequest, make_plan
from moe_runtime.planner.serving import Workload

MAX_GPUS = 4096          # nodes x GPUs per node the view plans for at most (the planner's work grows with it)
UNCALIBRATED_FALLBACK_GPU = "h100"   # this server's default on a CPU without a calibration
FALLBACK_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class PlanQuery:
    """The view's parameters; None: derived from the served engine (`resolve`)."""

    gpu: str | None = None
    gpus_per_node: int | None = None
    nodes: int = 1
    prompt_len: int | None = None
    output_len: int | None = None
    qps: float | None = None
    concurrency: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def validate(self) -> None:
        for name in ("gpus_per_node", "nodes", "prompt_len", "output_len", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name}={value}: must be >= 1")
        for name in ("qps", "ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name}={value}: must be > 0")
        if (self.gpus_per_node or 1) * self.nodes > MAX_GPUS:
            raise InvalidRequestError(f"gpus_per_node x nodes: at most {MAX_GPUS}")


def served_plan(config, query: PlanQuery, max_model_len: int,
                cpu_loader: Callable[[], Hardware] | None = None) -> dict:
    """The plan as `moe-serve plan --json` writes it, plus what was asked and which row is the served layout.

    `config`: the served engine's EngineConfig; `cpu_loader`: the `--gpu cpu` hardware (default: measured
    once on this machine and cached, see cpu_calibration.py)."""
    from moe_runtime.server.plan_cli import plan_json

    query.validate()
    device = _served_device(config)
    gpu = query.gpu or _default_gpu(device)
    per_node = query.gpus_per_node or _visible_devices(device)
    hardware, calibration = _hardware(gpu, cpu_loader or cpu_hardware, asked=query.gpu is not None)
    if hardware.name != gpu:   # no calibration of this CPU: the GPU table instead, and a line on calibrating
        gpu, per_node = hardware.name, query.gpus_per_node or FALLBACK_GPUS_PER_NODE
    prompt_len = query.prompt_len or max(min(1024, max_model_len // 2), 1)
    output_len = query.output_len or max(min(256, max_model_len // 4), 1)
    concurrency = None if query.qps is not None else (query.concurrency or config.max_num_seqs)
    workload = Workload(prompt_len, output_len, query.qps, concurrency, query.ttft_ms, query.itl_ms,
                        config.max_num_batched_tokens)
    shape = load_model_shape(config.model)
    request = PlanRequest(config.model, shape, hardware, per_node, query.nodes, workload,
                          resolve_precision(shape, config.dtype, config.quantization, config.cpu_experts,
                                            config.enable_torch_compile, config.deterministic), config.block_size,
                          kv_host_memory=config.kv_host_memory)
    answer = plan_json(make_plan(request))
    served = asdict(config.layout())
    for row in answer["rows"]:
        row["served"] = row["layout"] == served and not row["name"].startswith("P/D")
    answer["query"] = dict(gpu=gpu, gpus_per_node=per_node, nodes=query.nodes, prompt_len=prompt_len,
                           output_len=output_len, qps=query.qps, concurrency=concurrency, ttft_ms=query.ttft_ms,
                           itl_ms=query.itl_ms)
    answer["served_layout"] = served
    answer["gpu_choices"] = [*known_gpus(), "cpu"]
    answer["calibration"] = calibration
    return _finite(answer)


def _hardware(gpu: str, cpu_loader: Callable[[], Hardware], asked: bool) -> tuple[Hardware, str | None]:
    """The hardware to plan on, and what to tell about calibrating (None: nothing). An uncalibrated `cpu` that
    was asked for is an error naming the command; one that is only this server's default falls back."""
    try:
        return resolve_hardware(gpu, cpu_loader), None
    except CpuNotCalibratedError as exc:
        if asked:
            raise
        return resolve_hardware(UNCALIBRATED_FALLBACK_GPU, cpu_loader), f"planned for {UNCALIBRATED_FALLBACK_GPU}: {exc}"


def _finite(value):
    """JSON has no infinity: a time the planner could not give (a layout that does not keep up) is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _served_device(config) -> str:
    if config.device != "auto":
        return config.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_gpu(device: str) -> str:
    """`cpu` on the CPU; on CUDA the table's entry whose name the device's contains (else ask for ?gpu=)."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name().lower()
    for known in known_gpus():
        if known in name:
            return known
    raise InvalidRequestError(f"this server's GPU ({name}) is not in the planner's table: pass ?gpu= one of "
                              f"{', '.join(known_gpus())}")


def _visible_devices(device: str) -> int:
    if device == "cpu":
        return os.cpu_count() or 1
    import torch

    return max(torch.cuda.device_count(), 1)
