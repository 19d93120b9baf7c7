"""Child process of `bench/gpu_check.py`: runs one part's checks and appends each result to a JSONL file.

    python bench/gpu_check_part.py --part kernels --mode '{"dry_run": true, ...}' --events FILE [--skip a,b]

Events, one JSON object per line, flushed as they happen so the parent keeps what finished when this
process dies (a CUDA illegal memory access poisons the context for the rest of the process) or is
killed at its part's timeout: {"event": "plan", "checks": [...]}, {"event": "start", "check": name},
{"event": "result", ...CheckResult}. The parent restarts it with --skip for what already ran.

GPU_CHECK_CRASH_AT=<part>/<check> makes this process die at that check's start (tests use it to
exercise the parent's crash handling).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (str(BENCH), str(REPO), str(REPO / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu_check_mode import RunMode  # noqa: E402
from gpu_check_report import CheckResult  # noqa: E402

CRASH_AT_ENV = "GPU_CHECK_CRASH_AT"
CRASH_EXIT_CODE = 70


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--mode", required=True, help="RunMode as JSON")
    parser.add_argument("--events", required=True)
    parser.add_argument("--skip", default="", help="comma-separated checks already recorded")
    args = parser.parse_args()
    mode = RunMode.from_json(args.mode)
    events = EventLog(Path(args.events))
    skip = {name for name in args.skip.split(",") if name}
    crash_at = os.environ.get(CRASH_AT_ENV, "")

    part = importlib.import_module(args.module).build_part(mode)
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
    sys.exit(main())
