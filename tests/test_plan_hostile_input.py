"""`moe-serve plan` against hostile config files (red team round 3): every one ends in one line,
`moe-serve plan: error: <field>: <why>`, exit 2, within 2 s and 300 MB, in a process of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_runtime.planner.config_checks import MAX_CONFIG_BYTES

CONFIGS = Path(__file__).parent / "plan_configs"
DEEPSEEK_V3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
LLAMA = json.loads((CONFIGS / "llama-3.1-70b.json").read_text())
TIME_BOUND_S = 2.0
MEMORY_BOUND_BYTES = 300 * 2**20


def with_fields(base: dict, **fields) -> dict:
    return {**base, **fields}


# name -> (config text as bytes, the field the one line must name)
HOSTILE_JSON = {
    "layers_1e12_float": (with_fields(LLAMA, num_hidden_layers=1e12), "num_hidden_layers"),
    "layers_1e12_int": (with_fields(LLAMA, num_hidden_layers=10**12), "num_hidden_layers"),
    "nan_size": (with_fields(LLAMA, hidden_size=float("nan")), "config.json"),
    "infinite_size": (with_fields(LLAMA, hidden_size=float("inf")), "config.json"),
    "string_size": (with_fields(LLAMA, hidden_size="8192"), "hidden_size"),
    "null_size": (with_fields(LLAMA, hidden_size=None), "hidden_size"),
    "list_size": (with_fields(LLAMA, hidden_size=[8192]), "hidden_size"),
    "negative_size": (with_fields(LLAMA, intermediate_size=-5), "intermediate_size"),
    "zero_size": (with_fields(LLAMA, hidden_size=0), "hidden_size"),
    "zero_heads": (with_fields(LLAMA, num_attention_heads=0), "num_attention_heads"),
    "true_size": (with_fields(LLAMA, num_hidden_layers=True), "num_hidden_layers"),
    "fractional_size": (with_fields(LLAMA, hidden_size=255.5), "hidden_size"),
    "evil_dtype": (with_fields(LLAMA, torch_dtype="evil"), "torch_dtype"),
    "zero_experts": (with_fields(DEEPSEEK_V3, n_routed_experts=0), "num_experts"),
    "top_k_zero": (with_fields(DEEPSEEK_V3, num_experts_per_tok=0), "num_experts_per_tok"),
    "top_k_above_experts": (with_fields(DEEPSEEK_V3, num_experts_per_tok=300), "num_experts_per_tok"),
    "empty_text_config": (with_fields(LLAMA, text_config={}), "text_config"),
    "architectures_string": (with_fields(LLAMA, architectures="LlamaForCausalLM"), "architectures"),
    "quantization_list": (with_fields(DEEPSEEK_V3, quantization_config=[1, 2]), "config.json"),
    "layer_types_short": (with_fields(LLAMA, layer_types=["full_attention"]), "config.json"),
}
HOSTILE_BYTES = {
    "huge_integer": (b'{"architectures": ["LlamaForCausalLM"], "hidden_size": ' + b"9" * 5000 + b"}", "config.json"),
    "deep_nesting": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "config.json"),
    "top_level_list": (b"[1, 2, 3]", "config.json"),
    "invalid_utf8": (b'{"architectures": ["Llama\xff\xfe"]}', "config.json"),
    "not_json": (b"{hidden_size: 5", "config.json"),
    "empty_file": (b"", "config.json"),
}


def run_plan(config_path: Path, scratch: Path) -> tuple[subprocess.CompletedProcess, float, int]:
    """The CLI in a child process: its result, wall time and the child's own peak resident bytes (VmHWM: the
    high-water mark of its own memory since exec; ru_maxrss would carry the forking parent's)."""
    peak_file = scratch / f"{config_path.parent.name}-{config_path.name}.peak"
    code = ("import atexit, pathlib, resource, sys\nfrom moe_runtime.server.cli import main\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({4 * MEMORY_BOUND_BYTES}, {4 * MEMORY_BOUND_BYTES}))\n"
            f"atexit.register(lambda: pathlib.Path({str(peak_file)!r}).write_text(str(1024 * int(next("
            "line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM'))))))\n"
            f"sys.exit(main(['plan', '--model', {str(config_path)!r}, '--gpu', 'h100', '--prompt-len', '512', "
            "'--output-len', '64', '--concurrency', '8']))\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    peak = int(peak_file.read_text()) if peak_file.exists() else MEMORY_BOUND_BYTES
    return result, elapsed, peak


def assert_one_line_refusal(result: subprocess.CompletedProcess, elapsed: float, peak: int, field: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(f"moe-serve plan: error: {field}"), lines[0]
    assert not result.stdout.strip(), result.stdout[:500]     # no ranking printed for a bad config
    assert elapsed < TIME_BOUND_S + 1.5, elapsed               # + the interpreter's start-up
    assert peak < MEMORY_BOUND_BYTES, peak


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_hostile_config_values_end_in_one_line(case, tmp_path):
    config, field = HOSTILE_JSON[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))   # NaN and Infinity are written as JSON's non-standard literals
    assert_one_line_refusal(*run_plan(path, tmp_path), field)


@pytest.mark.parametrize("case", sorted(HOSTILE_BYTES))
def test_hostile_config_bytes_end_in_one_line(case, tmp_path):
    raw, field = HOSTILE_BYTES[case]
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    assert_one_line_refusal(*run_plan(path, tmp_path), field)


def test_a_config_that_is_no_regular_file_is_refused_before_reading(tmp_path):
    zero = tmp_path / "zero" / "config.json"
    zero.parent.mkdir()
    zero.symlink_to("/dev/zero")                   # grew to 5.9 GB in 12 s when read
    fifo = tmp_path / "fifo" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)                                # hung forever when opened
    for path in (zero, fifo, zero.parent, tmp_path / "missing.json"):
        result, elapsed, peak = run_plan(path, tmp_path)
        assert_one_line_refusal(result, elapsed, peak, str(path))


def test_an_oversized_config_file_is_refused_by_its_size(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "padding": "x" * MAX_CONFIG_BYTES}))
    result, elapsed, peak = run_plan(path, tmp_path)
    assert_one_line_refusal(result, elapsed, peak, str(path))
    assert "bytes" in result.stderr


def test_the_real_configs_still_plan(tmp_path):
    for name in ("deepseek-v3.json", "llama-3.1-70b.json"):
        result, _, _ = run_plan(CONFIGS / name, tmp_path)
        assert result.returncode == 0 and ("Winner" in result.stdout or "No layout" in result.stdout), result.stderr
