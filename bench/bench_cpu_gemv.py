"""Few-row projections on the CPU: the compiled GEMV (`moe_runtime/kernels/cpu_native`, `rows_linear`) against torch.

Decides where `moe_runtime/kernels/cpu_native/dense_gemv.py` uses the compiled kernel. Two settings, each on the MoE bench
checkpoint's projection shapes (hidden 512: q/o 512x512, k/v 256x512, LM head 8192x512) and the dense bench
model's (hidden 768: 2048x768 gate/up, 768x2048 down, LM head 8192x768), float32 and bfloat16 weights, 1-16 rows:

- **eager**: one call, `linear_rows` (the torch family's few-row rule over MKL) against the compiled kernel
  called directly and through its torch operator (`torch.ops.moe_cpu.rows_linear`, what a captured step calls);
- **captured**: a chain of 8 projections of one weight shape compiled with inductor, as a captured decode step
  runs them: `linear_rows` traced (the fused multiply-reduce GEMV at one row, an extern GEMM above) against the
  operator.

Modes alternate within each round (A B B A), so load from other processes hits them alike; the median of the
rounds is kept. Writes bench/results/cpu_gemv.json with the load average and `contended` (load above 1.5).

    python bench/bench_cpu_gemv.py [--rounds 5] [--rows 1 2 4 8 16] [--shapes moe_qo ...] [--no-captured]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_runtime.kernels.cpu_native import custom_ops
from moe_runtime.kernels.cpu_native.build import native_experts
from moe_runtime.kernels.skinny_matmul import linear_rows

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"moe_qo": (512, 512), "moe_kv": (256, 512), "moe_lm_head": (8192, 512),
          "dense_up": (2048, 768), "dense_down": (768, 2048), "dense_lm_head": (8192, 768)}
CHAIN = 8            # projections per compiled graph (distinct weights: each read from memory, as in a step)
CONTENDED_LOAD = 1.5


def time_call(fn, repeats: int) -> float:
    """Microseconds per call, best of three batches of `repeats`."""
    fn()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e6


def eager_modes(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    native = native_experts()
    cycle = {"i": 0}

    def next_weight() -> torch.Tensor:   # a different weight each call: streamed from memory, not cache
        cycle["i"] = (cycle["i"] + 1) % len(weights)
        return weights[cycle["i"]]

    return {"torch": lambda: linear_rows(x, next_weight()),
            "compiled": lambda: native.rows_linear(x, next_weight()),
            "compiled_op": lambda: torch.ops.moe_cpu.rows_linear(x, next_weight())}


def captured_modes(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    def chain_torch(x, *ws):
        return [linear_rows(x, w) for w in ws]

    def chain_op(x, *ws):
        return [torch.ops.moe_cpu.rows_linear(x, w) for w in ws]

    compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False) for name, fn in
                (("torch", chain_torch), ("compiled_op", chain_op))}
    return {name: (lambda fn=fn: fn(x, *weights)) for name, fn in compiled.items()}


def measure(modes: dict, rounds: int, repeats: int, per_call: int) -> dict:
    names = list(modes)
    samples = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order + order[::-1]:
            samples[name].append(time_call(modes[name], repeats) / per_call)
    return {name: round(statistics.median(values), 1) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-captured", action="store_true", help="eager calls only (no inductor compile)")
    parser.add_argument("--out", default="cpu_gemv.json")
    args = parser.parse_args()
    if custom_ops.operators() is None:
        raise SystemExit("the compiled CPU kernels did not build (no C++ compiler?): nothing to compare")
    load_before = os.getloadavg()[0]
    rows_out = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for shape_name in args.shapes:
                n, k = SHAPES[shape_name]
                weights = [torch.randn(n, k).to(dtype) * 0.05 for _ in range(CHAIN)]
                for rows in args.rows:
                    x = torch.randn(rows, k).to(dtype)
                    eager = measure(eager_modes(x, weights), args.rounds, 20, 1)
                    row = dict(dtype=str(dtype).removeprefix("torch."), shape=shape_name, n=n, k=k, rows=rows,
                               eager_us=eager, eager_speedup=round(eager["torch"] / eager["compiled_op"], 2))
                    if not args.no_captured:
                        captured = measure(captured_modes(x, weights), args.rounds, 5, CHAIN)
                        row.update(captured_us=captured,
                                   captured_speedup=round(captured["torch"] / captured["compiled_op"], 2))
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
    load_after = os.getloadavg()[0]
    result = dict(benchmark="cpu_gemv", torch=torch.__version__, threads=torch.get_num_threads(),
                  load_average=[round(load_before, 2), round(load_after, 2)],
                  contended=max(load_before, load_after) > CONTENDED_LOAD,
                  note="us per projection (captured: per projection of an 8-projection compiled chain); "
                       "speedup = torch / compiled operator", rows=rows_out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
