"""`moe-serve plan --kv-host-memory`: the tokens of evicted prefixes a rank's host tier keeps (host bytes over the
rank's KV bytes per token, whole blocks), beside the device's KV tokens in the table, the explanation and --json,
with the flag in each row's command; and those tokens are what a real engine's host tier holds."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.memory import host_tier_tokens, rank_memory, resolve_precision
from moe_runtime.planner.model_shape import load_model_shape
from moe_runtime.server.cli import main as cli_main
from moe_runtime.server.flag_types import parse_size

CONFIGS = Path(__file__).parent / "plan_configs"
LLAMA_70B = CONFIGS / "llama-3.1-70b.json"
DEEPSEEK_V3 = CONFIGS / "deepseek-v3.json"
WORKLOAD = ["--gpus-per-node", "8", "--prompt-len", "2048", "--output-len", "512", "--concurrency", "64"]
ASK = ["--gpu", "h100", *WORKLOAD]


def plan_json(capsys, *args) -> dict:
    assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_text(capsys, *args) -> str:
    assert cli_main(["plan", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("config, hardware", [(LLAMA_70B, ["--gpu", "h100"]),
                                              (DEEPSEEK_V3, ["--gpu", "h200", "--nodes", "2"])], ids=["gqa", "mla"])
def test_each_row_counts_the_host_tier_per_rank_and_per_instance(capsys, config, hardware):
    host = 64 * 2**30
    plan = plan_json(capsys, "--model", str(config), *hardware, *WORKLOAD, "--kv-host-memory", "64G")
    assert plan["kv_host_memory"] == host
    running = [row for row in plan["rows"] if row["runs"]]
    assert running
    for row in running:
        per_rank = host // (row["kv_bytes_per_token"] * 16) * 16       # whole blocks of the rank's shard
        assert row["host_kv_tokens_per_rank"] == per_rank > 0, row["name"]
        assert row["host_kv_tokens"] == per_rank * row["layout"]["dp_attn"], row["name"]
        flags = shlex.split(row["command"].split("[", 1)[-1].rstrip("]"))
        assert parse_size(flags[flags.index("--kv-host-memory") + 1]) == host, row["command"]


def test_a_shard_split_over_more_ranks_keeps_more_tokens_per_rank(capsys):
    plan = plan_json(capsys, "--model", str(LLAMA_70B), *ASK, "--kv-host-memory", "32G")
    by_name = {row["name"]: row for row in plan["rows"] if row["runs"]}
    assert by_name["tp8"]["host_kv_tokens_per_rank"] == 2 * by_name["tp4"]["host_kv_tokens_per_rank"]


def test_the_table_and_explanation_show_host_tokens_beside_the_device_tokens(capsys):
    text = plan_text(capsys, "--model", str(LLAMA_70B), *ASK, "--kv-host-memory", "64G", "--top", "3")
    plan = plan_json(capsys, "--model", str(LLAMA_70B), *ASK, "--kv-host-memory", "64G")
    header = next(line for line in text.splitlines() if line.startswith("#  layout"))
    columns = header.split("  ")
    columns = [c.strip() for c in columns if c.strip()]
    assert columns.index("host tok/inst") == columns.index("KV tok/inst") + 1
    winner = plan["rows"][0]
    first_row = next(line for line in text.splitlines() if line.startswith("1  "))
    assert f"{winner['kv_tokens']:,}" in first_row and f"{winner['host_kv_tokens']:,}" in first_row
    assert f"keeps {winner['host_kv_tokens_per_rank']:,} tokens of evicted prefixes per rank" in text
    assert "--kv-host-memory 64G" in text


def test_without_the_flag_nothing_changes(capsys):
    text = plan_text(capsys, "--model", str(LLAMA_70B), *ASK)
    plan = plan_json(capsys, "--model", str(LLAMA_70B), *ASK)
    assert "host tok/inst" not in text and "Host tier" not in text and "--kv-host-memory" not in text
    assert plan["kv_host_memory"] == 0
    assert all(row["host_kv_tokens"] == row["host_kv_tokens_per_rank"] == 0 for row in plan["rows"])


def test_host_tier_tokens_are_whole_blocks_and_zero_without_a_tier():
    assert host_tier_tokens(0, 1024, 16) == 0
    assert host_tier_tokens(10 * 1024 * 16 + 5, 1024, 16) == 160
    assert host_tier_tokens(10 * 1024 * 16 - 1, 1024, 16) == 144


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_the_planned_tokens_are_what_the_engines_host_tier_holds(tiny_checkpoint_factory, arch):
    """The engine's host tier keeps capacity // (its full-group entry bytes) blocks: the planner's tokens per rank."""
    from moe_runtime.engine.core import EngineCore
    from moe_runtime.kv_tiers.tier_key import FULL_GROUP

    path = tiny_checkpoint_factory(arch)
    shape = load_model_shape(path)
    host = parse_size("3M") + 12345
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory=2 * 2**20, max_num_seqs=4,
                          max_num_batched_tokens=256, kv_host_memory=host)
    core = EngineCore(config)
    try:
        [host_tier] = core.tiers.store.tiers
        engine_blocks = host // host_tier.sizes.by_kind[FULL_GROUP]   # the bytes the tier counts per block
    finally:
        shutdown = getattr(core, "shutdown", None)
        if shutdown:
            shutdown()
    memory = rank_memory(shape, ParallelLayout(), resolve_precision(shape, "float32", None), config.block_size, 4, 256)
    assert host_tier_tokens(host, memory.kv_bytes_per_token, config.block_size) == engine_blocks * config.block_size
