"""The GPU check: the whole GPU path of moe-runtime in one run, with JSON evidence and a summary.

`bench/gpu_check.sh` is the entry point (it installs carried wheels, then runs this); its header says
how to run it on a lent GPU. Parts (supervisor.PARTS has their budgets):

  environment   versions, the device, the packages the parts need
  kernels       every Triton kernel vs its torch twin at DeepSeek-V3 shapes, bf16 (routing also fp32)
  attention     varlen paged prefill and split-context decode (Triton; FlashInfer where it imports) vs torch
  parity        LLM(device="cuda") greedy tokens vs transformers, every tiny architecture: fp32 exact,
                bf16 close; ep=2 when two GPUs are visible
  serve         moe-serve --device cuda on the demo model answers a completion
  moe_layer     bench/bench_moe_layer.py on the GPU vs transformers' MoE block
  offline       offline generation vs transformers generate on the GPU
  captured      --enable-torch-compile: decode replayed as CUDA graphs gives the eager tokens
  captured_ep   ep=2 with DeepEP low latency: no host read in a decode step; the captured EP step gives the
                eager tokens (needs 2 GPUs and deep_ep; the dry run uses the tests' DeepEP emulation)
  cpu_experts   --cpu-experts: routed experts in host memory (hot ones on the device) give the on-device tokens
  kernel_cases  tests/triton_kernel_cases.py compiled on the GPU (edge cases, bf16 + fp32)

Each part runs in its own process under a hard timeout; a check that fails, raises, or crashes its
process is recorded and the run goes on. Exit status: 0 when every check passed or was skipped
(with its reason), 1 otherwise, 2 when there is no GPU (without --dry-run) or the arguments are bad.

    python -m bench.gpu_check                      # on a CUDA machine: bench/results/gpu_check.json
    python -m bench.gpu_check --dry-run            # CPU rehearsal: bench/results/gpu_check_dry_run.json
    python -m bench.gpu_check --only parity,serve  # a rerun of some parts: gpu_check_only-parity-serve.json
    GPU_CHECK_DRY_RUN=1 python -m bench.gpu_check  # the same as --dry-run

(from the repository root: `bench` is found there.) The package: report.py (RunMode, Outcome, the
results and the report), supervisor.py (the parts and their budgets, each part's processes),
environment.py, kernels.py + kernel_shapes.py, models.py (parity, offline, captured) and programs.py
(serve, moe_layer, kernel_cases).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .report import CheckReport, PartResult, RunMode, summary_table
from .supervisor import BENCH, PART_NAMES, PARTS, run_part, select_parts

DRY_RUN_ENV = "GPU_CHECK_DRY_RUN"
# The run stops starting parts after this. Dry: ~90 s of CPU work, but a 2-core machine shared with
# other jobs stretches it 2-4x.
DEFAULT_TOTAL_TIMEOUT_S = {"gpu": 540.0, "dry_run": 420.0}
WRITE_RESERVE_S = 5.0
EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help=f"CPU rehearsal: device cpu, Triton in its interpreter, small shapes (or {DRY_RUN_ENV}=1)")
    parser.add_argument("--tiny", action="store_true", help="the smallest meaningful subset of each part")
    parser.add_argument("--only", default="", help=f"comma-separated parts to run: {','.join(PART_NAMES)}")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    parser.add_argument("--results-dir", default=str(BENCH / "results"))
    parser.add_argument("--total-timeout", type=float, default=None,
                        help="seconds after which no part starts and running ones are cut "
                             f"(default {DEFAULT_TOTAL_TIMEOUT_S['gpu']:.0f} on the GPU, "
                             f"{DEFAULT_TOTAL_TIMEOUT_S['dry_run']:.0f} dry)")
    parser.add_argument("--keep-work-dir", action="store_true", help="keep the scratch directory (checkpoints, logs)")
    parser.add_argument("--list", action="store_true", help="print the parts and their budgets, then exit")
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or os.environ.get(DRY_RUN_ENV, "").strip().lower() in ("1", "true", "yes")
    args.only = [name for name in args.only.split(",") if name]
    args.skip = [name for name in args.skip.split(",") if name]
    return args


def results_file_name(dry_run: bool, tiny: bool, only: list[str], skip: list[str]) -> str:
    """A partial run never overwrites the full run's file: its name says what it holds."""
    name = "gpu_check_dry_run" if dry_run else "gpu_check"
    if only or skip:
        name += "_only-" + "-".join(p.name for p in select_parts(only, skip))
    if tiny:
        name += "_tiny"
    return name + ".json"


def print_plan(parts, dry_run: bool) -> None:
    print(f"{'part':13} {'budget':>7} {'limit':>6}  what")
    for part in parts:
        print(f"{part.name:13} {part.budget_s(dry_run):6.0f}s {part.timeout_s(dry_run):5.0f}s  {part.summary}")
    print(f"{'total':13} {sum(p.budget_s(dry_run) for p in parts):6.0f}s", flush=True)


def environment_of(part: PartResult) -> dict:
    return {check.name: check.details for check in part.checks}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        parts = select_parts(args.only, args.skip)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.list:
        print_plan(PARTS, args.dry_run)
        return EXIT_OK
    label = "dry_run" if args.dry_run else "gpu"
    total_timeout = args.total_timeout or DEFAULT_TOTAL_TIMEOUT_S[label]
    results_path = Path(args.results_dir) / results_file_name(args.dry_run, args.tiny, args.only, args.skip)
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    mode = RunMode(dry_run=args.dry_run, tiny=args.tiny, work_dir=str(work_dir))
    report = CheckReport(
        mode=label, command=[sys.executable, "-m", "bench.gpu_check", *(sys.argv[1:] if argv is None else argv)],
        results_file=str(results_path), started_at=time.time(), total_timeout_s=total_timeout,
        planned_parts=[spec.name for spec in parts],
        notice=("DRY RUN on CPU (Triton interpreter, small shapes): rehearses the GPU check's code paths; "
                "it is not GPU evidence") if args.dry_run else "GPU run",
    )
    started = time.monotonic()
    deadline = started + total_timeout - WRITE_RESERVE_S
    print(f"gpu_check ({report.notice}); results -> {results_path}; total limit {total_timeout:.0f} s")
    print_plan(parts, args.dry_run)
    exit_code = EXIT_OK
    try:
        for spec in parts:
            print(f"\n=== [{time.monotonic() - started:5.0f}s] {spec.name}: {spec.summary} "
                  f"(budget {spec.budget_s(args.dry_run):.0f} s, hard limit {spec.timeout_s(args.dry_run):.0f} s)",
                  flush=True)
            part = run_part(spec, mode, deadline, work_dir)
            report.parts.append(part)
            over = "  OVER BUDGET" if part.elapsed_s > part.budget_s else ""
            print(f"--- {spec.name}: {part.status} in {part.elapsed_s:.1f} s (budget {part.budget_s:.0f} s){over}"
                  + (f"; {part.note}" if part.note else ""), flush=True)
            if spec.name == "environment":
                report.environment = environment_of(part)
                if not args.dry_run and report.environment.get("device", {}).get("cuda_available") is False:
                    print("\ngpu_check: no CUDA device is visible to torch: this machine cannot run the GPU check. "
                          "Run `bash bench/gpu_check.sh --dry-run` for the CPU rehearsal. No results written.",
                          file=sys.stderr)
                    return EXIT_UNUSABLE
            report.elapsed_s = round(time.monotonic() - started, 1)
            report.write(results_path)        # after every part: a killed run keeps what it had
        report.finished_at = time.time()
        report.elapsed_s = round(time.monotonic() - started, 1)
        report.write(results_path)
        print("\n" + summary_table(report), flush=True)
        exit_code = EXIT_OK if report.ok else EXIT_FAILED
    finally:
        if args.keep_work_dir:
            print(f"work dir kept: {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
