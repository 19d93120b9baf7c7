"""What a gpu_check run is made of and what it records: its mode, a check's outcome, the results and the report.

RunMode: how a run is set up, on the GPU or the CPU rehearsal (`--dry-run`), and how big. The
orchestrator passes it to every part's child process as JSON; parts read the device and the dtypes
from here, so the dry run goes through the same code with other values, never other code.

Outcome and Part: what one check returns, and the protocol every part module implements. A part
module defines `build_part(mode: RunMode) -> Part`. The child process (supervisor.py's child side)
asks it for its check names once, then runs them one by one; a part keeps whatever setup its checks
share (a tokenizer, checkpoints, a started server) on itself, built on first use.

CheckResult, PartResult, CheckReport: one result per check, grouped by part, and the summary.
Statuses: `passed`, `failed` (ran, outside its tolerance), `error` (raised), `timeout` (its part hit
the hard timeout while it ran), `not_run` (its part stopped before it: timeout, crash, global
deadline) and `skipped` (not applicable here, with the reason: e.g. ep=2 on one GPU). Only `passed`
and `skipped` count as success.

Nothing here imports torch: the parent process and the tests read it cheaply.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class RunMode:
    dry_run: bool          # CPU rehearsal: device cpu, Triton in its interpreter, small shapes
    tiny: bool             # the smallest meaningful subset (the dry-run test uses it)
    work_dir: str          # scratch space of this run: checkpoints, server logs, benchmark output

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def kernel_low_precision(self) -> str:
        """The 16-bit dtype the Triton kernels are checked in. On the GPU bf16 (what models run in);
        in the dry run fp16, because the Triton interpreter's `tl.dot` gives wrong results in bf16
        (measured: fused_moe off by 1e10) while fp16 works (tests/triton_kernel_cases.py does the same)."""
        return "float16" if self.dry_run else "bfloat16"

    @property
    def label(self) -> str:
        return "dry_run" if self.dry_run else "gpu"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunMode":
        return cls(**json.loads(text))


@dataclass
class Outcome:
    status: str                                   # passed | failed | skipped (errors are raised)
    details: dict = field(default_factory=dict)
    error: str | None = None


def passed(**details) -> Outcome:
    return Outcome("passed", details)


def failed(reason: str, **details) -> Outcome:
    return Outcome("failed", details, reason)


def skipped(reason: str, **details) -> Outcome:
    return Outcome("skipped", details, reason)


def judged(problems: list[str], **details) -> Outcome:
    """Passed when `problems` is empty, else failed with all of them."""
    return passed(**details) if not problems else failed("; ".join(problems), **details)


class Part(Protocol):
    def check_names(self) -> list[str]:
        """Every check this part will run, in order (unique names)."""

    def run(self, name: str) -> Outcome:
        """Run one check; raising records an `error` for it and the part goes on with the next."""

    def close(self) -> None:
        """Release what the checks shared (servers, GPU memory); called once at the end."""


SUCCESS = ("passed", "skipped")
STATUSES = ("passed", "failed", "error", "timeout", "not_run", "skipped")


@dataclass
class CheckResult:
    name: str                       # "<kernel or subject>/<case>/<dtype>", unique within its part
    status: str                     # one of STATUSES
    elapsed_s: float = 0.0
    details: dict = field(default_factory=dict)   # measurements, tolerances, ratios
    error: str | None = None        # why it failed / was skipped, or the exception's tail

    @property
    def ok(self) -> bool:
        return self.status in SUCCESS

    @classmethod
    def from_dict(cls, data: dict) -> "CheckResult":
        return cls(**{k: data[k] for k in ("name", "status", "elapsed_s", "details", "error") if k in data})


@dataclass
class PartResult:
    name: str
    budget_s: float                 # what the part should take (printed beside its elapsed time)
    timeout_s: float                # the hard limit it ran under
    status: str = "not_run"         # passed | failed | skipped | not_run
    elapsed_s: float = 0.0
    attempts: int = 0               # child processes started (more than 1: resumed after a crash)
    note: str | None = None         # why it stopped early, what was skipped
    checks: list[CheckResult] = field(default_factory=list)

    def finish(self) -> None:
        """Derive the part's status from its checks."""
        if not self.checks:
            self.status = "failed"
            self.note = self.note or "no check ran"
        elif all(c.status == "skipped" for c in self.checks):
            self.status = "skipped"
        else:
            self.status = "passed" if all(c.ok for c in self.checks) else "failed"

    def counts(self) -> dict[str, int]:
        return {status: sum(c.status == status for c in self.checks) for status in STATUSES}


@dataclass
class CheckReport:
    mode: str                       # "gpu" | "dry_run"
    command: list[str]
    results_file: str
    started_at: float
    parts: list[PartResult] = field(default_factory=list)
    planned_parts: list[str] = field(default_factory=list)   # a file missing some was cut short
    environment: dict = field(default_factory=dict)
    finished_at: float | None = None
    elapsed_s: float = 0.0
    total_timeout_s: float = 0.0
    notice: str = ""                # e.g. "dry run on CPU: not GPU evidence"

    @property
    def missing_parts(self) -> list[str]:
        ran = {p.name for p in self.parts}
        return [name for name in self.planned_parts if name not in ran]

    @property
    def ok(self) -> bool:
        return bool(self.parts) and not self.missing_parts and all(p.status in SUCCESS for p in self.parts)

    def summary(self) -> dict:
        totals = {status: 0 for status in STATUSES}
        for part in self.parts:
            for status, n in part.counts().items():
                totals[status] += n
        return {"ok": self.ok, "checks": totals,
                "parts": {p.name: p.status for p in self.parts}, "missing_parts": self.missing_parts,
                "failed_checks": [f"{p.name}/{c.name}" for p in self.parts for c in p.checks if not c.ok]}

    def to_dict(self) -> dict:
        data = asdict(self)
        data["summary"] = self.summary()
        return data

    def write(self, path: Path) -> None:
        """Atomic write: a reader (or a kill mid-write) never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(path.name + ".partial")
        scratch.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        os.replace(scratch, path)


def summary_table(report: CheckReport) -> str:
    """One line per part (checks by status, elapsed vs budget), then every check that did not pass."""
    lines = [f"{'part':13} {'status':8} {'pass':>4} {'fail':>4} {'err':>4} {'t/o':>4} {'n/r':>4} {'skip':>4} "
             f"{'elapsed':>8} {'budget':>7} {'limit':>6}"]
    for part in report.parts:
        n = part.counts()
        lines.append(f"{part.name:13} {part.status:8} {n['passed']:4d} {n['failed']:4d} {n['error']:4d} "
                     f"{n['timeout']:4d} {n['not_run']:4d} {n['skipped']:4d} {part.elapsed_s:7.1f}s "
                     f"{part.budget_s:6.0f}s {part.timeout_s:5.0f}s" + (f"  {part.note}" if part.note else ""))
    problems = [(p, c) for p in report.parts for c in p.checks if c.status != "passed"]
    if problems:
        lines.append("")
        for part, check in problems:
            reason = (check.error or "").strip().splitlines()
            lines.append(f"  {check.status:8} {part.name}/{check.name}" + (f": {reason[-1][:160]}" if reason else ""))
    totals = report.summary()["checks"]
    verdict = "PASS" if report.ok else "FAIL"
    lines.append("")
    lines.append(f"{verdict}: {totals['passed']} passed, {totals['failed']} failed, {totals['error']} errors, "
                 f"{totals['timeout']} timed out, {totals['not_run']} not run, {totals['skipped']} skipped "
                 f"in {report.elapsed_s:.0f} s ({report.mode}) -> {report.results_file}")
    return "\n".join(lines)
