"""gpu_check part `kernel_cases`: the Triton edge-case suite, tests/triton_kernel_cases.py, as it is.

On CUDA that file parametrizes itself to bf16 and fp32 and adds its `large` cases; in the dry run it
runs in the Triton interpreter in fp32 and fp16 (the part's child starts with TRITON_INTERPRET=1).
It runs under pytest in its own process; every test becomes a line in this check's details, and a
skipped test counts as a problem (a case that did not run proves nothing).
"""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged

REPO = Path(__file__).resolve().parents[1]
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
    def __init__(self, mode: RunMode):
        self.mode = mode

    def check_names(self) -> list[str]:
        return ["triton_kernel_cases"]

    def close(self) -> None:
        pass

    def run(self, name: str) -> Outcome:
        junit = Path(self.mode.work_dir) / "triton_kernel_cases.xml"
        command = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs",
                   f"--junitxml={junit}"]
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


def build_part(mode: RunMode) -> KernelCasesPart:
    return KernelCasesPart(mode)
