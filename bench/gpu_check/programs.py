"""gpu_check parts that run a program of this repository as it is, in its own process, and judge what it wrote.

  serve         `moe-serve` (python -m server.cli) on the demo model, asked for a completion over HTTP
  moe_layer     bench/bench_moe_layer.py, its JSON against transformers' MoE block
  kernel_cases  pytest on tests/triton_kernel_cases.py, its JUnit report

Each part's class says what its check holds the program to.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import httpx

from server_harness import ServerProcess

from .report import Outcome, RunMode, judged

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent


# ----------------------------------------------------------------------------------------------- serve

STARTUP_TIMEOUT_S = 90.0          # the first start also builds the demo model
MAX_TOKENS = 16
KERNEL_CHOICE = re.compile(r"MoE kernels: (\w+) on (\S+)")


class ServePart:
    """Part `serve`: `moe-serve --device <the run's device>` on the demo model answers a completion.

    Started as tests/server_harness.py's `ServerProcess` does (`python -m server.cli`, the module behind
    the `moe-serve` console script, on a free loopback port, waiting for /health): on a machine where the
    project is not pip-installed the entry point is not on PATH, the module always is. The server's log
    says which kernel family it chose; on CUDA that must be Triton.
    """

    def __init__(self, mode: RunMode):
        self.mode = mode

    def check_names(self) -> list[str]:
        return ["demo_completion"]

    def close(self) -> None:
        pass

    def run(self, name: str) -> Outcome:
        started = time.perf_counter()
        server = ServerProcess(["--device", self.mode.device, "--log-level", "info"],
                               startup_timeout_s=STARTUP_TIMEOUT_S)
        with server:
            ready_s = time.perf_counter() - started
            models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
            model = models["data"][0]["id"]
            asked = time.perf_counter()
            reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0.0})
            latency_s = time.perf_counter() - asked
        exit_code = server.process.returncode if server.process else None
        log = list(server.log)
        choice = KERNEL_CHOICE.search("\n".join(log))
        problems = []
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        if reply.status_code != 200:
            problems.append(f"/v1/completions answered {reply.status_code}: {reply.text[:300]}")
        else:
            text = body["choices"][0]["text"]
            completion_tokens = body.get("usage", {}).get("completion_tokens", 0)
            if not isinstance(text, str) or not 1 <= completion_tokens <= MAX_TOKENS:
                problems.append(f"odd completion: text {text!r}, {completion_tokens} tokens")
        kernels = choice.group(1) if choice else None
        if self.mode.device == "cuda" and kernels != "triton":
            problems.append(f"the server ran the {kernels or 'unknown'} kernel family on CUDA, not triton")
        if exit_code not in (0, None):
            problems.append(f"moe-serve exited with {exit_code} on SIGTERM")
        return judged(problems, device=self.mode.device, model=model, status=reply.status_code,
                      reply=body, kernels=kernels, kernel_device=choice.group(2) if choice else None,
                      ready_s=ready_s, latency_s=latency_s, exit_code=exit_code, log_tail=log[-25:])


# ------------------------------------------------------------------------------------------- moe_layer

SCRIPT = BENCH / "bench_moe_layer.py"
DIFF_FACTOR = 4.0
DIFF_FLOOR = {"fp32": 1e-5, "bf16": 2e-2}


class MoELayerPart:
    """Part `moe_layer`: bench/bench_moe_layer.py on the run's device, against transformers' MoE block.

    The benchmark script runs as it is (its own process, its own JSON, written into this run's scratch
    directory and embedded in the report). On the GPU: bf16, both layers (Qwen3-MoE and the scaled
    DeepSeek-V3 block), T = 1, 64, 2048, and its `runtime_torch` contender (the torch kernel family on
    CUDA) beside the Triton one. Speed is reported as ratios (x transformers' grouped_mm and eager
    blocks), never gated; correctness is: every (layer, T) has a runtime row with finite timings, and
    the runtime's output is as close to transformers' grouped_mm block as transformers' own eager block
    is (at most 4x its difference, or the dtype's floor).
    """

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


# ---------------------------------------------------------------------------------------- kernel_cases

CASES = REPO / "tests" / "triton_kernel_cases.py"
# The dry run and --tiny: the one-token MoE case through every stage. The whole suite runs in the
# interpreter in the ordinary test run (tests/test_kernels_triton.py); compiled, it runs on the GPU only.
SUBSET = "one_token"
PYTEST_TIMEOUT_S = 600                # the part's own hard timeout cuts it earlier


def junit_results(path: Path) -> list[dict]:
    results = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (found.get("message") or found.text or "")[:500]
                break
        results.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                        "message": message})
    return results


class KernelCasesPart:
    """Part `kernel_cases`: the Triton edge-case suite, tests/triton_kernel_cases.py, as it is.

    On CUDA that file parametrizes itself to bf16 and fp32 and adds its `large` cases; in the dry run it
    runs in the Triton interpreter in fp32 and fp16 (the part's child starts with TRITON_INTERPRET=1).
    It runs under pytest in its own process; every test becomes a line in this check's details, and a
    skipped test counts as a problem (a case that did not run proves nothing).
    """

    def __init__(self, mode: RunMode):
        self.mode = mode

    def check_names(self) -> list[str]:
        return ["triton_kernel_cases"]

    def close(self) -> None:
        pass

    def run(self, name: str) -> Outcome:
        junit = Path(self.mode.work_dir) / "triton_kernel_cases.xml"
        command = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs",
                   "-o", "addopts=", f"--junitxml={junit}"]   # one process, not the suite's xdist workers
        subset = self.mode.tiny or self.mode.dry_run
        if subset:
            command += ["-k", SUBSET]
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S)
        output = (run.stdout + run.stderr).strip().splitlines()
        if not junit.exists():
            return judged([f"pytest wrote no report (exit {run.returncode}): " + " | ".join(output[-15:])],
                          command=command)
        tests = junit_results(junit)
        counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
        problems = [f"{t['outcome']}: {t['test']}: {(t['message'] or '').splitlines()[0] if t['message'] else ''}"
                    for t in tests if t["outcome"] != "passed"]
        if not tests:
            problems.append("no test collected")
        slowest = sorted(tests, key=lambda t: -t["seconds"])[:5]
        return judged(problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []),
                      suite=str(CASES.relative_to(REPO)), selection=SUBSET if subset else "all",
                      triton="interpreter" if self.mode.dry_run else "compiled", counts=counts,
                      pytest_summary=output[-1] if output else "", slowest=slowest, tests=tests)

