"""moe-serve flags: sizes, validation with clear messages, the EngineConfig mapping, --help."""
import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_runtime.cli import ServeConfig, ServeConfigError, bind_socket, build_parser, main, parse_size

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,expected", [
    ("1024", 1024), ("512M", 512 * 2**20), ("2G", 2 * 2**30), ("1.5GiB", int(1.5 * 2**30)), ("64kb", 64 * 1024),
    ("256 MB", 256 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "5X"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_flags_map_onto_engine_config(tmp_path):
    args = build_parser().parse_args([
        "--model", str(tmp_path), "--device", "cpu", "--dtype", "bf16", "--max-num-seqs", "7",
        "--max-model-len", "300", "--kv-cache-memory", "64M", "--block-size", "8", "--max-queue", "3",
        "--api-key", "k", "--port", "0"])
    config = ServeConfig.from_args(args)
    config.validate()
    engine_config = config.engine_config(str(tmp_path))
    assert (engine_config.device, engine_config.dtype, engine_config.max_num_seqs) == ("cpu", "bf16", 7)
    assert (engine_config.max_model_len, engine_config.kv_cache_memory, engine_config.block_size) == (300, 64 * 2**20, 8)
    assert (config.max_queue, config.api_key, config.port, config.host) == (3, "k", 0, "127.0.0.1")
    assert engine_config.world_size == 1


@pytest.mark.parametrize("flags,message", [
    (["--node-rank", "2", "--nnodes", "2"], "--node-rank 2 must be < --nnodes 2"),
    (["--num-redundant-experts", "4"], "--num-redundant-experts 4 needs --ep > 1"),
    (["--eplb-interval", "100"], "--eplb-interval 100 needs --ep > 1"),
    (["--a2a-backend", "all_to_all"], "--a2a-backend all_to_all needs --ep > 1"),
    (["--dp-attn", "3", "--ep", "4"], "--dp-attn 3 must divide --ep 4"),
    (["--nnodes", "2", "--ep", "4"], "--nnodes 2 needs --master-port"),
    (["--model", "/no/such/dir"], "--model /no/such/dir: no such checkpoint directory"),
])
def test_bad_flag_combinations_name_the_flag(flags, message):
    config = ServeConfig.from_args(build_parser().parse_args(flags))
    with pytest.raises(ServeConfigError, match=message.replace("+", r"\+").replace("/", "/")):
        config.validate()


def test_layout_flags_the_engine_has_no_field_for_are_refused_by_name(tmp_path, monkeypatch):
    import moe_runtime.cli as cli

    monkeypatch.setattr(cli, "LAYOUT_FIELDS", cli.LAYOUT_FIELDS + ("future_knob",))
    monkeypatch.setattr(cli.ServeConfig, "future_knob", 0, raising=False)
    config = ServeConfig.from_args(build_parser().parse_args(["--ep", "2"]))
    config.future_knob = 3
    with pytest.raises(ServeConfigError, match="--future-knob 3: not available yet"):
        config.engine_config(str(tmp_path))


def test_expert_parallel_flags_reach_the_engine_config(tmp_path):
    config = ServeConfig.from_args(build_parser().parse_args(
        ["--ep", "4", "--dp-attn", "2", "--a2a-backend", "allgather", "--num-redundant-experts", "4",
         "--master-port", "29555"]))
    config.validate()
    engine_config = config.engine_config(str(tmp_path))
    assert engine_config.world_size == 4 and (engine_config.ep, engine_config.dp_attn) == (4, 2)
    assert (engine_config.a2a_backend, engine_config.num_redundant_experts, engine_config.master_port) == \
        ("allgather", 4, 29555)


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--max-num-seqs", "0"], ["--device", "tpu"],
                                   ["--kv-cache-memory", "lots"], ["--a2a-backend", "pigeon"]])
def test_out_of_range_flags_exit_with_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(flags)
    assert info.value.code == 2
    flag = flags[0]
    assert flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    config = ServeConfig.from_args(build_parser().parse_args(["--device", "cuda"]))
    with pytest.raises(ServeConfigError, match="--device cuda: no CUDA device"):
        config.validate()


def test_main_reports_config_errors_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "/no/such/dir", "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "moe-serve: error: --model /no/such/dir" in err and "Traceback" not in err


def test_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ServeConfigError, match=f"--port {port}: cannot listen there"):
            bind_socket("127.0.0.1", port).close()


def test_help_runs_as_a_module():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "--help"], capture_output=True, text=True,
                            env=env, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    for flag in ("--model", "--dp-attn", "--ep", "--kv-cache-memory", "--max-queue", "--api-key", "--master-port"):
        assert flag in result.stdout
