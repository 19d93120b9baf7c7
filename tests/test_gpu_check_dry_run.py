"""bench/gpu_check's dry run (CPU, Triton interpreter): its cheapest meaningful subset, and its
handling of a check whose process dies.

The full dry run (`bash bench/gpu_check.sh --dry-run`, a few minutes) is recorded in
bench/results/gpu_check_dry_run.json; these tests keep the machinery honest in the ordinary run.
"""
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_check.report import CheckReport, CheckResult, PartResult, summary_table  # noqa: E402
from moe_runtime.kernels import KernelSet  # noqa: E402


def run_gpu_check(tmp_path: Path, *args: str, env_extra: dict | None = None):
    """Run the dry run into `tmp_path`; (the finished process, the JSON it wrote)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GPU_CHECK_DRY_RUN")}
    env.update(env_extra or {})
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--results-dir", str(tmp_path),
                          *args],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    [results] = tmp_path.glob("gpu_check_dry_run*.json")
    return run, json.loads(results.read_text())


def test_tiny_kernel_dry_run_checks_every_kernel_against_its_twin(tmp_path):
    run, report = run_gpu_check(tmp_path, "--only", "kernels", "--tiny")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert report["mode"] == "dry_run" and "not GPU evidence" in report["notice"]
    assert Path(report["results_file"]).name == "gpu_check_dry_run_only-environment-kernels_tiny.json"
    assert [p["name"] for p in report["parts"]] == ["environment", "kernels"]
    assert report["summary"]["ok"] and report["summary"]["failed_checks"] == []
    assert report["environment"]["device"]["device"] == "cpu"
    assert "torch" in report["environment"]["packages"]["versions"]

    kernels = next(p for p in report["parts"] if p["name"] == "kernels")
    assert kernels["status"] == "passed" and kernels["elapsed_s"] > 0 and kernels["budget_s"] > 0
    checked = {c["name"].split("/")[0] for c in kernels["checks"]}
    expected = {f.name for f in fields(KernelSet) if f.name != "name"} | {"align_block_size", "skinny_matmul"}
    assert expected <= checked
    for check in kernels["checks"]:
        assert check["status"] == "passed", check
        if check["name"].split("/")[0] in expected:
            assert check["details"]["tolerance"], check          # every kernel states its tolerance
        if "comparison" in check["details"]:
            assert check["details"]["comparison"]["violations"] == 0
    assert "PASS:" in run.stdout and "kernels" in run.stdout


def test_a_check_whose_process_dies_is_recorded_and_the_part_goes_on(tmp_path):
    run, report = run_gpu_check(tmp_path, "--only", "environment",
                                env_extra={"GPU_CHECK_CRASH_AT": "environment/packages"})
    assert run.returncode == 1, run.stdout[-3000:]
    [part] = report["parts"]
    by_name = {c["name"]: c for c in part["checks"]}
    assert by_name["packages"]["status"] == "error" and "died (exit 70)" in by_name["packages"]["error"]
    assert by_name["device"]["status"] == "passed"          # a fresh process ran the checks after it
    assert part["attempts"] == 2 and part["status"] == "failed"
    assert report["summary"]["failed_checks"] == ["environment/packages"]
    assert "FAIL:" in run.stdout


def test_summary_fails_on_any_failed_check_and_names_it():
    part = PartResult("kernels", budget_s=10, timeout_s=20, checks=[
        CheckResult("fused_moe/x/T1/bfloat16", "passed", 0.1),
        CheckResult("paged_decode_attention/y/B5/bfloat16", "failed", 0.2, error="3 elements outside rtol=0.02"),
        CheckResult("ep2_fp32_tokens/z", "skipped", 0.0, error="1 CUDA device visible")])
    part.finish()
    report = CheckReport(mode="gpu", command=[], results_file="r.json", started_at=0.0, parts=[part])
    assert part.status == "failed" and not report.ok
    assert report.summary()["failed_checks"] == ["kernels/paged_decode_attention/y/B5/bfloat16"]
    table = summary_table(report)
    assert "FAIL:" in table and "3 elements outside" in table and "1 CUDA device visible" in table
