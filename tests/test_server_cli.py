"""moe-serve flags: sizes, validation with clear messages, the ServerConfig / EngineConfig mapping, --help."""
import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.server.cli import build_parser, engine_config_from_args, main, server_config_from_args
from moe_runtime.server.flag_types import parse_size
from moe_runtime.server.listen_socket import bind_socket
from moe_runtime.server.server_config import ServerConfig, ServerConfigError

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
    config, engine_config = server_config_from_args(args), engine_config_from_args(args)
    config.validate()
    engine_config.validate()
    assert (engine_config.device, engine_config.dtype, engine_config.max_num_seqs) == ("cpu", "bf16", 7)
    assert (engine_config.max_model_len, engine_config.kv_cache_memory, engine_config.block_size) == (300, 64 * 2**20, 8)
    assert (config.max_queue, config.api_keys, config.port, config.host) == (3, ("k",), 0, "127.0.0.1")
    assert engine_config.world_size == 1


def test_context_parallel_flag_sets_the_worker_split(tmp_path):
    engine_config = engine_config_from_args(build_parser().parse_args(["--model", str(tmp_path), "--ep", "4",
                                                                       "--dp-attn", "2", "--cp", "2"]))
    layout = engine_config.layout()
    assert (engine_config.cp, layout.world_size, layout.dp_size, layout.attn_tp) == (2, 4, 2, 1)


@pytest.mark.parametrize("flags,message", [
    (["--node-rank", "2", "--nnodes", "2"], "--node-rank 2 must be < --nnodes 2"),
    (["--num-redundant-experts", "4"], "--num-redundant-experts 4 needs --ep > 1"),
    (["--eplb-interval", "100"], "--eplb-interval 100 needs --ep > 1"),
    (["--a2a-backend", "all_to_all"], "--a2a-backend all_to_all needs --ep > 1"),
    (["--dp-attn", "3", "--ep", "4"], "--dp-attn 3 must divide --ep 4"),
    (["--nnodes", "2", "--ep", "4"], "--nnodes 2 needs --master-port"),
    (["--ep", "2", "--cp", "2", "--enable-two-batch-overlap"], "--cp 2 with --enable-two-batch-overlap"),
])
def test_bad_engine_flag_combinations_name_the_flag(flags, message):
    engine_config = engine_config_from_args(build_parser().parse_args(flags))
    with pytest.raises(EngineConfigError, match=message.replace("+", r"\+")):
        engine_config.validate()


def test_missing_model_directory_names_the_flag():
    config = server_config_from_args(build_parser().parse_args(["--model", "/no/such/dir"]))
    with pytest.raises(ServerConfigError, match="--model /no/such/dir: no such checkpoint directory"):
        config.validate()


def test_every_flag_is_a_field_of_exactly_one_config():
    """No setting is written twice: each flag lands in ServerConfig or EngineConfig, with that field's default
    (EngineConfig.model is the resolved --model, set at launch)."""
    server_fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    assert not server_fields.keys() & engine_fields.keys()
    defaults = vars(build_parser().parse_args([]))
    for name, value in defaults.items():
        owner = server_fields.get(name) or engine_fields.get(name)
        assert owner is not None, f"flag destination {name!r} is no config field"
        assert value == owner.default, name
    assert server_fields.keys() <= defaults.keys()


def test_expert_parallel_flags_reach_the_engine_config():
    engine_config = engine_config_from_args(build_parser().parse_args(
        ["--ep", "4", "--dp-attn", "2", "--a2a-backend", "allgather", "--num-redundant-experts", "4",
         "--master-port", "29555"]))
    engine_config.validate()
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
    engine_config = engine_config_from_args(build_parser().parse_args(["--device", "cuda"]))
    with pytest.raises(EngineConfigError, match="--device cuda: no CUDA device"):
        engine_config.validate()


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
        with pytest.raises(ServerConfigError, match=f"--port {port}: cannot listen there"):
            bind_socket("127.0.0.1", port).close()


def test_help_runs_as_a_module():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-m", "moe_runtime.server.cli", "--help"], capture_output=True, text=True,
                            env=env, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    for flag in ("--model", "--dp-attn", "--ep", "--kv-cache-memory", "--max-queue", "--api-key", "--master-port"):
        assert flag in result.stdout


def test_help_is_parsed_before_the_server_and_the_engine_are_imported():
    """--help and usage errors come before the serving stack loads (uvicorn, the engine's processes)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_runtime.server.cli", "--help"], capture_output=True,
                            text=True, env=env, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "moe-serve" in result.stdout
    assert not {"torch", "fastapi", "uvicorn", "transformers", "moe_runtime.server.serve", "moe_runtime.processes.node_launcher",
                "moe_runtime.front.multiprocess_engine"} & imported


def test_help_says_what_each_flag_does_without_misleading_defaults():
    help_text = " ".join(build_parser().format_help().split())
    assert "/dashboard" in help_text.split("options:")[0]          # the description names the dashboard
    external = help_text.split("--external-workers start")[1].split("--control-key-file CONTROL_KEY_FILE")[0]
    assert "default" not in external                              # was "(default: True)": a switch has none
    log_level = help_text.split("--log-level {debug,info,warning,error}")[-1]   # its entry, not the usage line
    assert "one line per finished request" in log_level and "(default: info)" in log_level
    assert "(default: 8000)" in help_text and "(default: None)" not in help_text


def test_main_says_it_is_starting_before_loading_the_engine(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "/no/such/dir", "--port", "0"])
    assert capsys.readouterr().out.startswith("moe-serve: starting")


@pytest.mark.parametrize("is_demo", [True, False], ids=["demo", "checkpoint"])
def test_ready_lines_name_the_model_the_dashboard_and_the_demo(is_demo):
    from moe_runtime.server.serve import ready_lines

    serving, dashboard = ready_lines("moe-runtime-demo", "http://127.0.0.1:8000", is_demo=is_demo).splitlines()
    assert serving.startswith("moe-serve: serving 'moe-runtime-demo'") and serving.endswith(
        "on http://127.0.0.1:8000 (Ctrl-C to stop)")
    assert ("seeded random weights" in serving) == is_demo
    assert dashboard == "moe-serve: dashboard at http://127.0.0.1:8000/dashboard"


def test_api_key_repeats_for_tenants_and_pd_takes_one():
    parser = build_parser()
    config = server_config_from_args(parser.parse_args(["--api-key", "tenant-a-key", "--api-key", "tenant-b-key"]))
    config.validate()
    assert config.api_keys == ("tenant-a-key", "tenant-b-key")
    assert server_config_from_args(parser.parse_args([])).api_keys == ()
    with pytest.raises(ServerConfigError, match="twice"):
        server_config_from_args(parser.parse_args(["--api-key", "k", "--api-key", "k"])).validate()
    with pytest.raises(ServerConfigError, match="--pd takes one --api-key"):
        server_config_from_args(parser.parse_args(["--pd", "1:1", "--api-key", "a", "--api-key", "b"])).validate()


def test_the_command_runs_the_exit_handlers_flushes_and_ends_with_mains_code():
    """`moe-serve` ends without the interpreter's teardown (2-3 s per stop, measured from SIGTERM on the demo
    model): the exit handlers still run, what was printed still arrives, and the exit code is `main`'s."""
    script = ("import atexit, sys\n"
              "from moe_runtime.server import cli\n"
              "cli.main = lambda: (print('served', end=''), 3)[1]\n"
              "atexit.register(lambda: sys.stderr.write('handlers ran'))\n"
              "cli.console_main()\n"
              "print('not reached')\n")
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (ended.returncode, ended.stdout, ended.stderr) == (3, "served", "handlers ran")
