"""Running Triton kernel case files in Triton's interpreter, in a child process (the interpreter is chosen by
TRITON_INTERPRET when triton is imported, so a test process that already imported it compiled cannot switch).

One child per run for every case file (its start-up, torch, triton and pytest imports, cost each of the five
modules that had a child of its own some seconds): a test that needs it is marked
`@pytest.mark.triton_interpreter_cases(*case_files)`; once the run's tests are collected, the first worker that
collected such a test starts the child in the background on the union of their case files (shared_builds.py's
directory: both xdist workers see it), with a JUnit report. Each marked test then waits for the child and holds
its own case files to it: every case of theirs ran and passed, none skipped.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "triton_interpreter_cases"
CHILD_TIMEOUT_S = 600   # from the child's start: the whole child, as one subprocess.run of it allowed before

# Runs the child, then writes its exit code whole (a waiter reading "rc" knows the report is complete).
RUNNER = """
import os, subprocess, sys
rc_path, log_path, *command = sys.argv[1:]
with open(log_path, "w") as log:
    rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
with open(rc_path + ".tmp", "w") as out:
    out.write(str(rc))
os.replace(rc_path + ".tmp", rc_path)
"""


def marked_case_files(items) -> list[Path]:
    """The case files of the collected tests marked `triton_interpreter_cases`, in a stable order."""
    files = {Path(case).resolve() for item in items for marker in item.iter_markers(MARKER) for case in marker.args}
    return sorted(files)


class SharedInterpreterRun:
    """The run's one interpreter child, in `root / "triton-interpreter"`."""

    def __init__(self, root: Path):
        self.dir = root / "triton-interpreter"

    def start(self, cases: list[Path]) -> None:
        """Start the child on `cases` unless a worker already did (whatever its cases: every worker collects the
        same tests)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (self.dir / "started.json").exists():
                return
            env = {**os.environ, "TRITON_INTERPRET": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"),
                                                               os.environ.get("PYTHONPATH")]))}
            env.pop("MOE_ATTENTION_BACKEND", None)   # the attention backend left to its choice
            env.pop("PYTEST_XDIST_WORKER", None)
            # -o addopts=: one process (not the suite's two xdist workers: this child serves tests of it)
            command = [sys.executable, "-m", "pytest", *map(str, cases), "-q", "-p", "no:cacheprovider",
                       "-o", "addopts=", "--timeout", "300", "-o", "junit_family=xunit1",
                       f"--junitxml={self.dir / 'report.xml'}", "--continue-on-collection-errors"]
            runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(self.dir / "rc"), str(self.dir / "output.log"),
                                       *command], cwd=REPO, env=env, start_new_session=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (self.dir / "started.json").write_text(json.dumps({"pid": runner.pid, "at": time.time(),
                                                               "cases": [str(c) for c in cases]}))

    def assert_cases_pass(self, cases: list[Path]) -> None:
        """Every case of `cases` passed in the child (none skipped, none missing)."""
        started = json.loads((self.dir / "started.json").read_text())
        missing = [str(c) for c in cases if str(Path(c).resolve()) not in started["cases"]]
        assert not missing, f"the interpreter child was started without {missing}"
        rc = self._wait(started)
        log = (self.dir / "output.log").read_text()
        assert rc in (0, 1), f"the interpreter child exited {rc}\n{log[-8000:]}"
        outcomes = self._outcomes()
        for case in cases:
            name = Path(case).name
            found = outcomes.get(name, [])
            bad = [(test, outcome) for test, outcome in found if outcome != "passed"]
            assert found and not bad, (f"{name}: {len(found)} cases, not passed: {bad[:20]}\n"
                                       + _log_of(log, name)[-8000:])

    def _wait(self, started: dict) -> int:
        deadline = started["at"] + CHILD_TIMEOUT_S
        while not (self.dir / "rc").exists():
            if time.time() > deadline:
                _kill(started["pid"])
                pytest.fail(f"the interpreter child did not finish within {CHILD_TIMEOUT_S}s\n"
                            + (self.dir / "output.log").read_text()[-8000:])
            if not _alive(started["pid"]) and not (self.dir / "rc").exists():
                pytest.fail("the interpreter child's runner died without a result\n"
                            + (self.dir / "output.log").read_text()[-8000:])
            time.sleep(0.2)
        return int((self.dir / "rc").read_text())

    def _outcomes(self) -> dict[str, list[tuple[str, str]]]:
        """case file name -> [(test, "passed" | "failure" | "error" | "skipped")] from the JUnit report."""
        outcomes: dict[str, list[tuple[str, str]]] = {}
        for case in ElementTree.parse(self.dir / "report.xml").iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes.setdefault(Path(file).name, []).append((case.get("name", "?"), kinds[0] if kinds else "passed"))
        return outcomes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # our own child that exited and was not reaped yet is a zombie: gone too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


def _log_of(log: str, name: str) -> str:
    """The child's output from the first line naming `name` (its failures), else all of it."""
    index = log.find(name)
    return log[max(0, index - 200):] if index >= 0 else log


def assert_cases_pass_in_interpreter(request, cases: list[Path]) -> None:
    """Every case of `cases` passes in the run's interpreter child (the test must be marked with them)."""
    marked = {Path(c).resolve() for marker in request.node.iter_markers(MARKER) for c in marker.args}
    assert {Path(c).resolve() for c in cases} <= marked, f"mark the test @pytest.mark.{MARKER}(...) with {cases}"
    from shared_builds import shared_root

    run = SharedInterpreterRun(shared_root(request.getfixturevalue("tmp_path_factory")))
    if not (run.dir / "started.json").exists():   # not started at collection (e.g. a plugin reordered hooks)
        run.start(marked_case_files([request.node]))
    run.assert_cases_pass(cases)
