"""The accelerators the planner knows, from public spec sheets, and `--gpu custom.json` for any other.

Figures are per GPU, dense (no 2:4 sparsity), and scale-up bandwidth is one direction (what a ring
all-reduce or an all-to-all can push out of one GPU). Sources:
  H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (80 GB HBM3, 3.35 TB/s, BF16 989 / FP8 1979 TFLOPS dense
             (the sheet's 1979 / 3958 are with sparsity), NVLink 900 GB/s bidirectional).
  H200 SXM:  NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, compute as H100, NVLink 900 GB/s bidirectional).
  B200:      NVIDIA DGX B200 datasheet (1,440 GB and 64 TB/s for 8 GPUs: 180 GB, 8 TB/s each; 72 PFLOPS FP8
             training with sparsity for 8: 4.5 dense FP8, 2.25 dense BF16 per GPU; NVLink 5 1.8 TB/s bidirectional).
  MI300X:    AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, BF16 1307 / FP8 2615 TFLOPS dense, 7 Infinity
             Fabric links of 64 GB/s per direction: 448 GB/s).
Scale-out: one 400 Gb/s NIC per GPU (ConnectX-7 in DGX H100/H200/B200; MI300X platforms likewise): 50 GB/s.

Nobody reaches peak: `*_efficiency` are the fractions a tuned engine sustains (about 80% of HBM bandwidth
in decode GEMVs, 60% of dense FLOP/s across a layer's mixed GEMMs, 70% of link bandwidth in NCCL/DeepEP
collectives). `--gpu cpu` measures its own (cpu_calibration.py) and uses 1.0: measured rates already are
what a kernel gets.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from moe_runtime.errors import InvalidRequestError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float            # HBM per GPU
    hbm_bytes_s: float             # memory bandwidth
    bf16_flops: float              # dense BF16/FP16 FLOP/s
    fp8_flops: float               # dense FP8 FLOP/s (0: no FP8 matmul; FP8 weights then run at bf16 rate)
    scale_up_bytes_s: float        # per GPU, one direction, inside a node (NVLink, Infinity Fabric)
    scale_out_bytes_s: float       # per GPU, one direction, between nodes (NIC)
    fp32_flops: float = 0.0        # dense FP32 FLOP/s (0: half of bf16's)
    mem_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    link_efficiency: float = 0.7
    collective_latency_s: float = 10e-6   # one collective's fixed cost inside a node (network: x3)
    layer_overhead_s: float = 15e-6       # a decode layer's floor: kernel launches, norms, routing, sync
    step_overhead_s: float = 1e-3         # a step's host work: scheduling, sampling, detokenizing
    memory_reserve: float = 0.1           # share of memory kept for activations, graphs, communication buffers
    device: str = "cuda"                  # the --device of the commands
    cpu: Any = None                       # --gpu cpu: the measured CpuOverheads the roofline adds (cpu_overheads.py)

    def flops(self, dtype_bytes: float, fp8_weights: bool) -> float:
        """Sustained FLOP/s of a matmul in this dtype (FP8 weights multiply at the FP8 rate where there is one)."""
        if fp8_weights and self.fp8_flops:
            peak = self.fp8_flops
        elif dtype_bytes >= 4:
            peak = self.fp32_flops or self.bf16_flops / 2
        else:
            peak = self.bf16_flops
        return peak * self.compute_efficiency

    def link_bytes_s(self, crosses_nodes: bool) -> float:
        return (self.scale_out_bytes_s if crosses_nodes else self.scale_up_bytes_s) * self.link_efficiency

    def latency_s(self, crosses_nodes: bool) -> float:
        return self.collective_latency_s * (3 if crosses_nodes else 1)


def known_gpus() -> dict[str, Hardware]:
    """The built-in table (see the module's sources)."""
    return {
        "h100": Hardware("h100", 80 * GB, 3.35e12, 989e12, 1979e12, 450 * GB, 50 * GB),
        "h200": Hardware("h200", 141 * GB, 4.8e12, 989e12, 1979e12, 450 * GB, 50 * GB),
        "b200": Hardware("b200", 180 * GB, 8.0e12, 2250e12, 4500e12, 900 * GB, 50 * GB),
        "mi300x": Hardware("mi300x", 192 * GB, 5.3e12, 1307e12, 2615e12, 448 * GB, 50 * GB),
    }


def hardware_from_json(path: str | Path) -> Hardware:
    """A custom GPU: a JSON object of `Hardware`'s fields (name optional, the rest as in the table)."""
    with open(path) as f:
        values = json.load(f)
    names = {f.name for f in fields(Hardware)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise InvalidRequestError(f"--gpu {path}: unknown fields {unknown}; known: {sorted(names)}")
    values.setdefault("name", Path(path).stem)
    try:
        return Hardware(**values)
    except TypeError as exc:
        raise InvalidRequestError(f"--gpu {path}: {exc} (required: memory_bytes, hbm_bytes_s, bf16_flops, "
                                  "fp8_flops, scale_up_bytes_s, scale_out_bytes_s)") from exc


def resolve_hardware(gpu: str, cpu_loader: Callable[[], Hardware]) -> Hardware:
    """`--gpu`: a table name, `cpu` (calibrated on this machine by `cpu_loader`, e.g. cpu_calibration's
    `cpu_hardware`: given by the caller, since the calibration itself plans with this module's Hardware), or a
    JSON file."""
    table = known_gpus()
    if gpu.lower() in table:
        return table[gpu.lower()]
    if gpu.lower() == "cpu":
        return cpu_loader()
    if Path(gpu).is_file():
        return hardware_from_json(gpu)
    raise InvalidRequestError(f"--gpu {gpu}: choose one of {', '.join([*table, 'cpu'])} or a JSON file of "
                              "Hardware fields")


def with_memory(hardware: Hardware, memory_bytes: float) -> Hardware:
    return replace(hardware, memory_bytes=memory_bytes)
