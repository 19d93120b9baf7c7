"""Running Triton kernel case files in Triton's interpreter, in a child process (the interpreter is chosen by
TRITON_INTERPRET when triton is imported, so a test process that already imported it compiled cannot switch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def assert_cases_pass_in_interpreter(cases: list[Path]) -> None:
    """Every case of `cases` passes in the interpreter (none skipped), the attention backend left to its choice."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    env.pop("MOE_ATTENTION_BACKEND", None)
    # -o addopts=: one process (not the suite's two xdist workers: this child is one test of it)
    result = subprocess.run([sys.executable, "-m", "pytest", *map(str, cases), "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", "--timeout", "300"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, \
        result.stdout[-8000:] + result.stderr[-2000:]
