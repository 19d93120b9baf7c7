"""Int4 experts kept packed in the compiled CPU kernel (`--kernels cpu`, kernels/cpu_native/int4_dots.h) against the
torch family's int4 kernel and against bfloat16 / float32 experts through the cpu family's compiled `expert_mlp`,
side by side in one run, one thread.

One MoE layer of 64 experts, top-8 routing, hidden 1024, expert intermediate 512 (a Qwen3-30B-A3B-like expert
at a third of its width); int4 in groups of 128 columns with zero points (AWQ / GPTQ's layout; the symmetric
format reads the same codes and half the scale bytes). Decode batches of 1, 4 and 16 tokens and one prefill
chunk of 64 tokens, uniform routing, a different routing every call (8 of them, cycled) so the experts a call
reads are mostly not the ones the last call left in the caches (the layer's int4 experts are 52 MB against a
32 MB L3; its float32 ones 400 MB).

Reported per case: microseconds per layer (the best of 5 passes over the routings, 3 for prefill), the weight
bytes the call must read (codes and scales of the experts the batch touches), the GB/s that makes, and that over
the machine's read bandwidth measured in the same run (the best of 5 sums of a 512 MiB float32 tensor: what
streaming weights once can reach). Writes bench/results/int4_experts.json.

    python bench/bench_int4_experts.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_runtime.kernels.cpu_native.build import native_experts   # noqa: E402
from moe_runtime.kernels.cpu_native.expert_kernel import cpu_expert_mlp, cpu_int4_expert_mlp   # noqa: E402
from moe_runtime.kernels.int4_layout import Int4Layout, pack_int4   # noqa: E402
from moe_runtime.kernels.int4_weights import int4_expert_mlp   # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
EXPERTS, TOP_K, HIDDEN, INTER = 64, 8, 1024, 512
LAYOUT = Int4Layout(group_size=128, zero_points=True)
BATCHES = {1: "decode", 4: "decode", 16: "decode", 64: "prefill"}
ROUTINGS = 8


@dataclass(frozen=True)
class ExpertStack:
    """One layer's experts in one format: what a call passes and the bytes one expert occupies."""

    name: str
    tensors: tuple[torch.Tensor, ...]     # (w13, w2) or (w13, w13_scale, w2, w2_scale)
    expert_bytes: int


@dataclass(frozen=True)
class Case:
    weights: str
    kernel: str
    batch: int
    phase: str
    layer_us: float
    weight_bytes: int
    gbs: float
    share_of_read_bandwidth: float


def read_bandwidth_gbs() -> float:
    """The best of 5 sums over a 512 MiB float32 tensor: how fast this thread streams memory it only reads."""
    data = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def stacks(generator: torch.Generator) -> list[ExpertStack]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.05    # [E, 2I, H]
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * 0.05         # [E, H, I]
    int4 = [int4_of(w13, generator), int4_of(w2, generator)]
    return [ExpertStack("float32", (w13, w2), expert_bytes(w13, w2)),
            ExpertStack("bfloat16", (w13.bfloat16(), w2.bfloat16()), expert_bytes(w13, w2) // 2),
            ExpertStack("int4-g128-zp", (*int4[0], *int4[1]), expert_bytes(*int4[0], *int4[1]))]


def int4_of(w: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes in the layout with plausible scales (the values do not matter to the speed)."""
    rows, columns = w.shape[1], w.shape[2]
    codes = torch.randint(0, 16, w.shape, generator=generator, dtype=torch.uint8)
    groups = LAYOUT.groups(columns)
    scale = torch.rand(EXPERTS, rows, groups, generator=generator) * 0.01 + 0.001
    zero = torch.randint(0, 16, (EXPERTS, rows, groups), generator=generator).float()
    return pack_int4(codes), torch.stack((scale, zero), dim=-1)                   # [E, N, K/2], [E, N, G, 2]


def expert_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors) // EXPERTS


def routings(batch: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROUTINGS decode batches grouped by expert under uniform top-k routing: (x_sorted [B*K, H], counts [E])."""
    out = []
    for _ in range(ROUTINGS):
        choices = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(batch)])
        flat = choices.flatten()
        x = torch.randn(batch, HIDDEN, generator=generator)
        out.append((x[flat.argsort(stable=True) // TOP_K].contiguous(), torch.bincount(flat, minlength=EXPERTS)))
    return out


def kernels(stack: ExpertStack) -> dict[str, Callable]:
    """The kernels a format is run through: (x_sorted, counts) -> [N, H]."""
    if stack.name.startswith("int4"):
        return {"native": lambda x, c: cpu_int4_expert_mlp(x, c, *stack.tensors, layout=LAYOUT),
                "torch": lambda x, c: int4_expert_mlp(x, c, *stack.tensors, layout=LAYOUT)}
    return {"native": lambda x, c: cpu_expert_mlp(x, c, *stack.tensors)}


def time_per_call(fn: Callable, calls: list, rounds: int) -> float:
    """The best of `rounds` passes through every routing, per call (one pass of warm-up first): the least disturbed
    by other jobs on a shared machine."""
    for args in calls:
        fn(*args)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for args in calls:
            fn(*args)
        samples.append((time.perf_counter() - started) / len(calls))
    return min(samples)


def main() -> int:
    if native_experts() is None:
        print("the CPU expert kernel could not be built here (no C++ compiler?)")
        return 1
    torch.set_num_threads(1)
    machine = f"1 thread, {platform_line()}"
    generator = torch.Generator().manual_seed(0)
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth (one thread, 512 MiB sum): {bandwidth:.1f} GB/s", flush=True)
    formats = stacks(generator)
    cases = []
    for batch, phase in BATCHES.items():
        calls = routings(batch, generator)
        touched = statistics.mean(int((counts > 0).sum()) for _, counts in calls)
        for stack in formats:
            for kernel, fn in kernels(stack).items():
                seconds = time_per_call(fn, calls, rounds=3 if phase == "prefill" else 5)
                read = int(touched * stack.expert_bytes)
                cases.append(Case(stack.name, kernel, batch, phase, seconds * 1e6, read, read / seconds / 1e9,
                                  read / seconds / 1e9 / bandwidth))
                print(f"{phase:7s} batch {batch:3d} {stack.name:13s} {kernel:6s}: {seconds * 1e6:9.0f} us/layer, "
                      f"{read / 1e6:6.1f} MB read, {cases[-1].gbs:5.1f} GB/s "
                      f"({cases[-1].share_of_read_bandwidth:.0%} of the read bandwidth)", flush=True)
    by_key = {(c.weights, c.kernel, c.batch): c.layer_us for c in cases}
    ratios = []
    for batch, phase in BATCHES.items():
        native_int4 = by_key["int4-g128-zp", "native", batch]
        ratios.append(dict(batch=batch, phase=phase,
                           native_int4_over_torch_int4=by_key["int4-g128-zp", "torch", batch] / native_int4,
                           native_int4_over_native_bf16=by_key["bfloat16", "native", batch] / native_int4,
                           native_int4_over_native_fp32=by_key["float32", "native", batch] / native_int4))
    for row in ratios:
        print(f"batch {row['batch']:3d}: native int4 {row['native_int4_over_torch_int4']:.2f}x torch int4, "
              f"{row['native_int4_over_native_bf16']:.2f}x native bf16, {row['native_int4_over_native_fp32']:.2f}x "
              f"native fp32 (speedups: the other's time over native int4's)", flush=True)
    result = dict(machine=machine, read_bandwidth_gbs=bandwidth,
                  shape=dict(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
                             int4_layout=asdict(LAYOUT)),
                  cases=[asdict(c) for c in cases], speedups=ratios)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int4_experts.json").write_text(json.dumps(result, indent=1))
    return 0


def platform_line() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        model = ""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return f"{model or 'unknown CPU'}, load average {' '.join(load)} at the start"


if __name__ == "__main__":
    sys.exit(main())
