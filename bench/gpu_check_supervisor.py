"""Runs one gpu_check part in child processes: streams their output, enforces the hard timeout, and
resumes after a crash.

Each part runs in its own process group (a part may start servers and worker processes): at its
timeout the whole group is killed, and after it ends any process it left behind is too. A child that
dies in the middle of a check (a segfault, a CUDA illegal memory access, which leaves the CUDA
context unusable) gets that check recorded as an error, and a fresh child continues with the checks
after it while the part's time lasts.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_check_mode import RunMode
from gpu_check_parts import PartSpec
from gpu_check_report import CheckResult, PartResult

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CHILD = BENCH / "gpu_check_part.py"
MIN_ATTEMPT_S = 5.0         # a part with less time left than this does not start (another) child
MAX_ATTEMPTS = 4            # one start plus three resumes after crashes
KILL_GRACE_S = 5.0
OUTPUT_TAIL_LINES = 60


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
        command = [sys.executable, str(CHILD), "--part", spec.name, "--module", spec.module,
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
