"""gpu_check part `moe_layer`: bench/bench_moe_layer.py on the run's device, against transformers' MoE block.

The benchmark script runs as it is (its own process, its own JSON, written into this run's scratch
directory and embedded in the report). On the GPU: bf16, both layers (Qwen3-MoE and the scaled
DeepSeek-V3 block), T = 1, 64, 2048, and its `runtime_torch` contender (the torch kernel family on
CUDA) beside the Triton one. Speed is reported as ratios (x transformers' grouped_mm and eager
blocks), never gated; correctness is: every (layer, T) has a runtime row with finite timings, and
the runtime's output is as close to transformers' grouped_mm block as transformers' own eager block
is (at most 4x its difference, or the dtype's floor).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged

BENCH = Path(__file__).resolve().parent
SCRIPT = BENCH / "bench_moe_layer.py"
DIFF_FACTOR = 4.0
DIFF_FLOOR = {"fp32": 1e-5, "bf16": 2e-2}


class MoELayerPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.out = Path(mode.work_dir) / "moe_layer.json"
        if mode.dry_run or mode.tiny:
            self.dtype, self.layers = "fp32" if mode.dry_run else "bf16", "qwen3"
            self.tokens = "1"
            self.extra = ["--quick"]
        else:
            self.dtype, self.layers, self.tokens, self.extra = "bf16", "qwen3,deepseek", "1,64,2048", []

    def check_names(self) -> list[str]:
        return ["bench_moe_layer"]

    def close(self) -> None:
        pass

    def run(self, name: str) -> Outcome:
        command = [sys.executable, str(SCRIPT), "--device", self.mode.device, "--dtype", self.dtype,
                   "--layers", self.layers, "--tokens", self.tokens, "--out", str(self.out), *self.extra]
        run = subprocess.run(command, cwd=BENCH.parent, capture_output=True, text=True)
        output = (run.stdout + run.stderr).strip().splitlines()
        if run.returncode != 0 or not self.out.exists():
            return judged([f"bench_moe_layer.py exited with {run.returncode}: " + " | ".join(output[-12:])],
                          command=command)
        result = json.loads(self.out.read_text())
        rows = result["rows"]
        problems, ratios = [], []
        for layer in self.layers.split(","):
            for tokens in (int(t) for t in self.tokens.split(",")):
                mine = {r["contender"]: r for r in rows if r["layer"] == layer and r["tokens"] == tokens}
                runtime = mine.get("runtime")
                if runtime is None or not math.isfinite(runtime["ms"]):
                    problems.append(f"{layer} T={tokens}: no runtime timing")
                    continue
                bound = max(DIFF_FACTOR * mine["hf_eager"]["max_abs_diff"], DIFF_FLOOR[self.dtype])
                if not runtime["max_abs_diff"] <= bound:
                    problems.append(f"{layer} T={tokens}: runtime differs from transformers by "
                                    f"{runtime['max_abs_diff']:.3g} > {bound:.3g}")
                ratio = {"layer": layer, "tokens": tokens, "runtime_ms": runtime["ms"],
                         "x_hf_grouped": runtime["speedup_vs_hf"],
                         "x_hf_eager": mine["hf_eager"]["ms"] / runtime["ms"],
                         "max_abs_diff": runtime["max_abs_diff"],
                         "hf_eager_max_abs_diff": mine["hf_eager"]["max_abs_diff"]}
                if "runtime_torch" in mine:
                    ratio["x_runtime_torch_kernels"] = mine["runtime_torch"]["ms"] / runtime["ms"]
                ratios.append(ratio)
        speedups = {f"{r['layer']}/T{r['tokens']}": round(r["x_hf_grouped"], 2) for r in ratios}
        tolerance = f"max_abs_diff <= max({DIFF_FACTOR:g} x hf_eager's, {DIFF_FLOOR[self.dtype]:g})"
        return judged(problems, command=" ".join(command[1:]), kernels=result.get("kernels"),
                      device_name=result.get("device_name"), dtype=result.get("dtype"),
                      speedup_vs_transformers=speedups, ratios=ratios, tolerance=tolerance, benchmark=result,
                      output_tail=output[-30:])


def build_part(mode: RunMode) -> MoELayerPart:
    return MoELayerPart(mode)
