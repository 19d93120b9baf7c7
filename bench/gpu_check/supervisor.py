"""The parts of a gpu_check run, with their time budgets, and how each runs in its own processes.

The parts: `PARTS`, in the order they run. `budget_s` is what a part should take (printed beside its
elapsed time: a part far over it is a finding in itself); `timeout_s` is the hard limit after which
its process group is killed and its unfinished checks are recorded as `timeout` / `not_run`. GPU
figures are estimates for one H200 with a cold Triton cache (every kernel variant compiles once; not
yet measured: no GPU so far); dry-run figures were measured on the 2-core CPU dev machine shared
with other jobs (load average 7-8).

The parent side (`run_part`): streams a part's child processes' output, enforces the hard timeout,
and resumes after a crash. Each part runs in its own process group (a part may start servers and
worker processes): at its timeout the whole group is killed, and after it ends any process it left
behind is too. A child that dies in the middle of a check (a segfault, a CUDA illegal memory access,
which leaves the CUDA context unusable) gets that check recorded as an error, and a fresh child
continues with the checks after it while the part's time lasts.

The child side (`child_main`, this module run with -m): runs one part's checks and appends each
result to a JSONL file.

    python -m bench.gpu_check.supervisor --part kernels --factory bench.gpu_check.kernels:KernelsPart
        --mode '{"dry_run": true, ...}' --events FILE [--skip a,b]        (one command line)

Events, one JSON object per line, flushed as they happen so the parent keeps what finished when the
child dies (a CUDA illegal memory access poisons the context for the rest of the process) or is
killed at its part's timeout: {"event": "plan", "checks": [...]}, {"event": "start", "check": name},
{"event": "result", ...CheckResult}. The parent restarts it with --skip for what already ran.

GPU_CHECK_CRASH_AT=<part>/<check> makes the child die at that check's start (tests use it to
exercise the parent's crash handling).
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from .report import CheckResult, PartResult, RunMode

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
CHILD_MODULE = "bench.gpu_check.supervisor"      # run with -m: its child side below
MIN_ATTEMPT_S = 5.0         # a part with less time left than this does not start (another) child
MAX_ATTEMPTS = 4            # one start plus three resumes after crashes
KILL_GRACE_S = 5.0
OUTPUT_TAIL_LINES = 60
CRASH_AT_ENV = "GPU_CHECK_CRASH_AT"
CRASH_EXIT_CODE = 70


# --------------------------------------------------------------------------------------------------- the parts

@dataclass(frozen=True)
class PartSpec:
    name: str
    factory: str                # "module:Class": Class(mode) is the part (report.Part)
    summary: str
    gpu_budget_s: float
    gpu_timeout_s: float
    dry_budget_s: float
    dry_timeout_s: float
    triton_interpreter: bool = False   # dry run: the child starts with TRITON_INTERPRET=1

    def budget_s(self, dry_run: bool) -> float:
        return self.dry_budget_s if dry_run else self.gpu_budget_s

    def timeout_s(self, dry_run: bool) -> float:
        return self.dry_timeout_s if dry_run else self.gpu_timeout_s


PARTS: tuple[PartSpec, ...] = (
    PartSpec("environment", "bench.gpu_check.environment:EnvironmentPart",
             "versions, the device, the packages the other parts import",
             gpu_budget_s=10, gpu_timeout_s=60, dry_budget_s=8, dry_timeout_s=60),
    PartSpec("kernels", "bench.gpu_check.kernels:KernelsPart",
             "every Triton kernel vs its torch twin at DeepSeek-V3 shapes (bf16; routing also fp32)",
             gpu_budget_s=80, gpu_timeout_s=150, dry_budget_s=15, dry_timeout_s=60, triton_interpreter=True),
    PartSpec("attention", "bench.gpu_check.attention_kernels:AttentionKernelsPart",
             "varlen paged prefill and split-context decode (Triton; FlashInfer where it imports) vs the torch twins "
             "at DeepSeek-V3 MLA / Llama GQA shapes, bf16, timed",
             gpu_budget_s=60, gpu_timeout_s=150, dry_budget_s=15, dry_timeout_s=60, triton_interpreter=True),
    PartSpec("parity", "bench.gpu_check.models:ParityPart",
             "LLM(device=...) greedy tokens vs transformers on every tiny architecture: fp32 exact, bf16 close; ep=2",
             gpu_budget_s=100, gpu_timeout_s=170, dry_budget_s=60, dry_timeout_s=120),
    PartSpec("serve", "bench.gpu_check.programs:ServePart",
             "moe-serve --device on the demo model answers a completion",
             gpu_budget_s=40, gpu_timeout_s=100, dry_budget_s=45, dry_timeout_s=90),
    PartSpec("moe_layer", "bench.gpu_check.programs:MoELayerPart",
             "bench/bench_moe_layer.py: one MoE layer vs transformers' block (grouped_mm, eager)",
             gpu_budget_s=50, gpu_timeout_s=120, dry_budget_s=20, dry_timeout_s=60),
    PartSpec("offline", "bench.gpu_check.models:OfflinePart",
             "offline generation vs transformers generate (bench_offline.py's checkpoint and prompts; bf16 "
             "and --quantization fp8)",
             gpu_budget_s=70, gpu_timeout_s=140, dry_budget_s=45, dry_timeout_s=90),
    PartSpec("captured", "bench.gpu_check.models:CapturedPart",
             "--enable-torch-compile: decode replayed as CUDA graphs gives the eager tokens (bucket 4, a pad row), "
             "no graph skipped; ms per token captured vs eager",
             gpu_budget_s=90, gpu_timeout_s=180, dry_budget_s=40, dry_timeout_s=120),
    PartSpec("captured_ep", "bench.gpu_check.captured_ep:CapturedEpPart",
             "ep=2 decode captured whole with DeepEP low latency inside: no host read in eager decode steps, "
             "captured tokens equal eager (one worker idle too), ms per token (needs 2 GPUs and deep_ep)",
             gpu_budget_s=90, gpu_timeout_s=180, dry_budget_s=90, dry_timeout_s=180),
    PartSpec("cpu_experts", "bench.gpu_check.cpu_experts:CpuExpertsPart",
             "--cpu-experts: routed experts in host memory (two hot ones kept on the device) give the all-on-device "
             "tokens; ms per token offloaded vs on the device",
             gpu_budget_s=40, gpu_timeout_s=100, dry_budget_s=45, dry_timeout_s=90),
    # Last: the four checks the GPU run exists for come first; this one takes what time is left.
    PartSpec("kernel_cases", "bench.gpu_check.programs:KernelCasesPart",
             "tests/triton_kernel_cases.py compiled, bf16 + fp32 (empty batches, masked slots, partial tiles)",
             gpu_budget_s=60, gpu_timeout_s=120, dry_budget_s=20, dry_timeout_s=60, triton_interpreter=True),
)

PART_NAMES = tuple(part.name for part in PARTS)


def select_parts(only: list[str] | None, skip: list[str] | None) -> list[PartSpec]:
    """The parts to run: `environment` always (the report needs it), then `only` minus `skip`."""
    for name in (only or []) + (skip or []):
        if name not in PART_NAMES:
            raise ValueError(f"unknown part {name!r}; parts: {', '.join(PART_NAMES)}")
    chosen = [p for p in PARTS if (not only or p.name in only) and p.name not in (skip or [])]
    if PARTS[0] not in chosen:
        chosen.insert(0, PARTS[0])
    return chosen


# -------------------------------------------------------------------------------------------- the parent side

@dataclass
class ChildRun:
    returncode: int | None      # None: killed at the timeout
    timed_out: bool
    output_tail: list[str]


@dataclass
class PartEvents:
    """What one child wrote to the part's event file."""

    plan: list[str] | None
    results: list[CheckResult]
    started: dict[str, float]   # check -> wall time its start event was written


def child_environment(spec: PartSpec, mode: RunMode) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), str(REPO), str(REPO / "tests"),
                                                      env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")       # no progress bars and advice in the log
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MOE_KERNELS", None)            # check what "auto" picks, not an override left in the shell
    env.pop("TRITON_INTERPRET", None)
    if mode.dry_run and spec.triton_interpreter:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_child(command: list[str], env: dict[str, str], timeout_s: float, prefix: str) -> ChildRun:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               cwd=REPO, start_new_session=True, bufsize=1, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            print(f"{prefix}{line}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
    _signal_group(process.pid, signal.SIGKILL)   # whatever the part left running (servers, workers)
    reader.join(timeout=5)
    return ChildRun(None if timed_out else process.returncode, timed_out, list(tail))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def read_events(path: Path, offset: int) -> PartEvents:
    plan, results, started = None, [], {}
    if not path.exists():
        return PartEvents(plan, results, started)
    with path.open(encoding="utf-8") as file:
        file.seek(offset)
        for line in file:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue                      # the last line of a killed child may be cut
            kind = event.pop("event", None)
            if kind == "plan":
                plan = list(event["checks"])
            elif kind == "start":
                started[event["check"]] = event.get("t", time.time())
            elif kind == "result":
                event.pop("t", None)
                results.append(CheckResult.from_dict(event))
    return PartEvents(plan, results, started)


def run_part(spec: PartSpec, mode: RunMode, deadline: float, work_dir: Path) -> PartResult:
    """All of `spec`'s checks, within its timeout and the run's `deadline` (time.monotonic())."""
    result = PartResult(spec.name, spec.budget_s(mode.dry_run), spec.timeout_s(mode.dry_run))
    events_path = work_dir / f"{spec.name}.events.jsonl"
    started = time.monotonic()
    part_deadline = min(started + spec.timeout_s(mode.dry_run), deadline)
    result.timeout_s = round(part_deadline - started, 1)
    plan: list[str] | None = None
    done: dict[str, CheckResult] = {}
    notes: list[str] = []
    env = child_environment(spec, mode)
    while True:
        remaining = part_deadline - time.monotonic()
        if remaining < MIN_ATTEMPT_S:
            notes.append("out of time" if result.attempts else "no time left in the run's total budget")
            break
        if result.attempts >= MAX_ATTEMPTS:
            notes.append(f"gave up after {MAX_ATTEMPTS} crashed children")
            break
        result.attempts += 1
        offset = events_path.stat().st_size if events_path.exists() else 0
        command = [sys.executable, "-m", CHILD_MODULE, "--part", spec.name, "--factory", spec.factory,
                   "--mode", mode.to_json(), "--events", str(events_path), "--skip", ",".join(done)]
        run = run_child(command, env, remaining, prefix="  ")
        events = read_events(events_path, offset)
        plan = plan or events.plan
        for check in events.results:
            done[check.name] = check
        unfinished = [name for name in events.started if name not in done]
        if run.timed_out:
            if plan is None:
                done["setup"] = CheckResult("setup", "timeout", time.monotonic() - started, {},
                                            "the part's process had not listed its checks at the hard timeout; "
                                            "its output ended with:\n" + "\n".join(run.output_tail[-25:]))
            for name in unfinished:
                done[name] = CheckResult(name, "timeout", time.time() - events.started[name], {},
                                         f"the part reached its hard timeout ({result.timeout_s:.0f} s) "
                                         "while this check ran")
            notes.append(f"hard timeout after {time.monotonic() - started:.0f} s")
            break
        if run.returncode == 0:
            break
        output = "\n".join(run.output_tail[-25:])
        if plan is None:
            done["setup"] = CheckResult("setup", "error", time.monotonic() - started, {},
                                        f"the part's process exited with {run.returncode} before listing "
                                        f"its checks; its output ended with:\n{output}")
            break
        for name in unfinished:
            done[name] = CheckResult(name, "error", time.time() - events.started[name], {},
                                     f"the part's process died (exit {run.returncode}) during this check; "
                                     f"its output ended with:\n{output}")
        notes.append(f"process died (exit {run.returncode})" + (f" during {unfinished[0]}" if unfinished else ""))
        if not unfinished and all(name in done for name in plan):
            break                             # died while closing: every check has its result
    for name in plan or []:
        if name not in done:
            done[name] = CheckResult(name, "not_run", 0.0, {}, notes[-1] if notes else "not reached")
    order = (plan or []) + [name for name in done if name not in (plan or [])]
    result.checks = [done[name] for name in order]
    result.elapsed_s = round(time.monotonic() - started, 2)
    result.note = "; ".join(dict.fromkeys(notes)) or None
    result.finish()
    return result


# --------------------------------------------------------------------------------------------- the child side

class EventLog:
    def __init__(self, path: Path):
        self.file = path.open("a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "t": time.time(), **fields}, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def describe(result: CheckResult) -> str:
    """One progress line: status, name, time and the figures a reader looks for first."""
    keys = ("max_abs_err", "tolerance", "speedup_vs_torch_twin", "tokens_equal", "argmax_agreement",
            "first_token_agreement", "kernels", "speedup_vs_transformers", "speedup_vs_eager", "pytest_summary",
            "latency_s")
    shown = ", ".join(f"{k}={_short(result.details[k])}" for k in keys if k in result.details)
    tail = f"  {shown}" if shown else ""
    if result.error and result.status != "passed":
        tail += f"  [{result.error.strip().splitlines()[-1][:200]}]"
    return f"    {result.status:7} {result.name}  {result.elapsed_s:.1f}s{tail}"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def child_main() -> int:
    for path in (str(BENCH), str(REPO), str(REPO / "tests")):
        if path not in sys.path:
            sys.path.insert(0, path)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True)
    parser.add_argument("--factory", required=True, help='"module:Class" of the part')
    parser.add_argument("--mode", required=True, help="RunMode as JSON")
    parser.add_argument("--events", required=True)
    parser.add_argument("--skip", default="", help="comma-separated checks already recorded")
    args = parser.parse_args()
    mode = RunMode.from_json(args.mode)
    events = EventLog(Path(args.events))
    skip = {name for name in args.skip.split(",") if name}
    crash_at = os.environ.get(CRASH_AT_ENV, "")

    module, _, factory = args.factory.partition(":")
    part = getattr(importlib.import_module(module), factory)(mode)
    names = part.check_names()
    events.write("plan", checks=names)
    try:
        for name in names:
            if name in skip:
                continue
            events.write("start", check=name)
            if crash_at == f"{args.part}/{name}":
                os._exit(CRASH_EXIT_CODE)
            started = time.perf_counter()
            try:
                outcome = part.run(name)
                result = CheckResult(name, outcome.status, time.perf_counter() - started, outcome.details,
                                     outcome.error)
            except Exception:  # noqa: BLE001 - one check's exception is its result; the part goes on
                result = CheckResult(name, "error", time.perf_counter() - started, {},
                                     traceback.format_exc(limit=8)[-4000:])
            events.write("result", **asdict(result))
            print(describe(result), flush=True)
    finally:
        part.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
