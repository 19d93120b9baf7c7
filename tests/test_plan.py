"""`moe-serve plan`: every supported architecture answers quickly, the 70B example's figures, and the KV
capacity it predicts equals the engine's own block count (timings are the calibration bench's to check)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_checkpoints import TINY_ARCHS, tiny_config, tiny_tokenizer

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.hardware import known_gpus
from moe_runtime.planner.memory import kv_capacity, rank_memory, resolve_precision, window_pool_blocks
from moe_runtime.planner.model_shape import PLANNED_ARCHITECTURES, load_model_shape
from moe_runtime.server.cli import main as cli_main

CONFIGS = Path(__file__).parent / "plan_configs"
LLAMA_70B = CONFIGS / "llama-3.1-70b.json"
DEEPSEEK_V3 = CONFIGS / "deepseek-v3.json"


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory):
    """config.json of every tiny architecture (no weights: the planner reads only the config)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = tmp_path_factory.mktemp("plan_tiny")
    tokenizer = tiny_tokenizer()
    paths = {}
    for arch in TINY_ARCHS:
        path = root / arch
        config = tiny_config(arch, tokenizer)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]   # what save_pretrained writes
        path.mkdir()
        config.to_json_file(str(path / "config.json"))
        paths[arch] = path
    return paths


def _plan_json(capsys, *args) -> dict:
    assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_planner_reads_every_architecture_the_runtime_serves():
    from moe_runtime.models.registry import supported_architectures

    assert set(supported_architectures()) <= set(PLANNED_ARCHITECTURES)


@pytest.mark.parametrize("gpu", sorted(known_gpus()))
def test_every_tiny_architecture_answers_in_under_a_second(tiny_configs, capsys, gpu):
    for arch, path in tiny_configs.items():
        started = time.perf_counter()
        plan = _plan_json(capsys, "--model", str(path), "--gpu", gpu, "--gpus-per-node", "8", "--prompt-len", "256",
                          "--output-len", "64", "--qps", "2")
        assert time.perf_counter() - started < 1.0, arch
        winner = plan["rows"][0]
        assert winner["runs"] and winner["command"].startswith(("moe-serve ", "1 x", "2 x")), (arch, winner)
        assert "--model" in winner["command"] and plan["explanation"].startswith("Winner"), arch


def test_planning_imports_no_torch():
    """A fresh `moe-serve plan` on a GPU table reads configs only: importing torch alone takes seconds (the
    in-process timings above run after other tests imported it)."""
    script = ("import sys, contextlib, io\nfrom moe_runtime.server.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              f"    main(['plan', '--model', {str(LLAMA_70B)!r}, '--gpu', 'h100', '--prompt-len', '2048', "
              "'--output-len', '512', '--concurrency', '64'])\n"
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("config, gpu, nodes", [(LLAMA_70B, "h100", 1), (DEEPSEEK_V3, "h200", 4)])
def test_large_configs_answer_in_under_a_second(capsys, config, gpu, nodes):
    started = time.perf_counter()
    plan = _plan_json(capsys, "--model", str(config), "--gpu", gpu, "--nodes", str(nodes), "--prompt-len", "2048",
                      "--output-len", "512", "--qps", "2", "--ttft-ms", "2000", "--itl-ms", "50")
    assert time.perf_counter() - started < 1.0
    assert plan["rows"][0]["meets_slo"]
    refused = [row for row in plan["rows"] if not row["runs"]]
    assert refused and all(row["reason"] for row in refused)


def test_llama_70b_figures():
    shape = load_model_shape(LLAMA_70B)
    bf16 = resolve_precision(shape, "auto", None)
    one = rank_memory(shape, ParallelLayout(), bf16)
    assert round(one.weight_bytes / 1e9) == 141                   # 141 GB of bf16 weights
    assert one.kv_bytes_per_token == 320 * 1024                   # 80 layers x 8 KV heads x 128 x (K+V) x 2 bytes
    usable = known_gpus()["h100"].memory_bytes * 0.9
    tp2, tp4 = (rank_memory(shape, ParallelLayout(tp=tp), bf16) for tp in (2, 4))
    left2, left4 = usable - tp2.weight_bytes, usable - tp4.weight_bytes
    assert left2 < 2e9 < 30e9 < left4                             # tp2 leaves KV for a few requests, tp4 for hundreds
    fp8 = rank_memory(shape, ParallelLayout(tp=2), resolve_precision(shape, "auto", "fp8"))
    assert usable - fp8.weight_bytes > 30e9                       # FP8 halves the weights: tp2 then has room


def test_window_pool_rule_is_the_runtimes():
    from moe_runtime.kv_blocks.kv_groups import window_pool_blocks as runtime_rule
    from moe_runtime.layers.attention_span import SLIDING, AttentionSpan

    for window, block, seqs, budget in ((10, 16, 64, 4096), (4096, 16, 3, 100), (128, 32, 7, 8192)):
        assert window_pool_blocks(window, block, seqs, budget) == runtime_rule(AttentionSpan(SLIDING, window), block,
                                                                               seqs, budget)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "deepseek_v32",
                                  "glm_moe_dsa"])
def test_kv_capacity_is_the_engines_block_count(tiny_checkpoint_factory, arch):
    """Full, MLA, sliding-window and chunked layers, and sparse MLA layers with their index keys (GLM-5's shared
    layer without): the predicted blocks are exactly those the engine makes."""
    from moe_runtime.engine.core import EngineCore

    path = tiny_checkpoint_factory(arch)
    shape = load_model_shape(path)
    for budget, seqs in ((3 * 2**20, 8), (1_234_567, 5)):
        config = EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory=budget,
                              max_num_seqs=seqs, max_num_batched_tokens=256)
        core = EngineCore(config)
        try:
            engine_blocks = core.block_manager.num_blocks
        finally:
            shutdown = getattr(core, "shutdown", None)
            if shutdown:
                shutdown()
        memory = rank_memory(shape, ParallelLayout(), resolve_precision(shape, "float32", None), config.block_size,
                             seqs, 256)
        predicted = kv_capacity(memory, ParallelLayout(), budget, config.block_size, 64)
        assert predicted.blocks_per_worker == engine_blocks, (arch, budget)


@pytest.mark.parametrize("schedule", [dict(index_topk_freq=3, index_skip_topk_offset=2), dict(index_topk_pattern="FFSFS"),
                                      dict(index_topk_freq=2, index_skip_topk_offset=1)])
def test_glm5_indexer_layers_without_their_list_are_transformers(schedule, tmp_path):
    """A GLM-5 config.json may give its indexer schedule instead of `indexer_types`: the planner reads the same
    layers as indexer layers (their index keys counted) as transformers derives."""
    import transformers

    want = transformers.GlmMoeDsaConfig(num_hidden_layers=5, **schedule).indexer_types
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 5,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "intermediate_size": 96,
              "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 8, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 4,
              **schedule}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kv_dims = [layer.kv_dim for layer in load_model_shape(tmp_path).layers]
    assert kv_dims == [24 + 16 if kind == "full" else 24 for kind in want]


def test_calibration_bench_machinery_quick():
    """The calibration bench's predict/measure on one layout (timings are printed by the bench, not asserted here;
    its KV capacity must be exact)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.bench_offline import build_checkpoint
    from bench.bench_plan_calibration import measure, predict

    from moe_runtime.planner.calibration.cpu_calibration import cpu_hardware, measure_rates

    path = build_checkpoint("float32")
    # the machine's rates alone (about a second): the full calibration's step measurements belong to the bench
    predicted = predict(path, {}, 2, 8, 2, hardware=cpu_hardware(measure_rates(), overheads=None))
    measured = measure(path, {}, 2, 8, 2, repeats=1)
    assert predicted["kv_tokens_per_worker"] == measured["kv_tokens_per_worker"]
    assert predicted["decode_tok_s"] > 0 and measured["decode_tok_s"] > 0


def test_a_calibration_cache_of_another_version_is_measured_again(tmp_path, monkeypatch):
    """The cache is only a cache: an entry in another format (or a broken file) means measuring again, not a crash."""
    import json as json_module
    import os
    import platform

    from moe_runtime.planner.calibration import cpu_calibration
    from moe_runtime.planner.calibration.cpu_calibration import CpuRates

    fresh = CpuRates("here", 2, 1e10, 2e10, 1e-5)
    monkeypatch.setattr(cpu_calibration, "measure_rates", lambda: fresh)
    monkeypatch.setattr(cpu_calibration, "measure_overheads", lambda rates: None)
    cache = tmp_path / "calibration.json"
    cache.write_text(json_module.dumps({f"{platform.node()}/{os.cpu_count()}": {"rates": {"rates": 1}}}))
    assert cpu_calibration.cached_calibration(cache) == (fresh, None)
    cache.write_text("{not json")
    assert cpu_calibration.cached_calibration(cache) == (fresh, None)


def test_planning_for_an_uncalibrated_cpu_names_the_command_and_never_measures(tmp_path, monkeypatch, capsys):
    """`--gpu cpu` reads the calibration cache only: without an entry it is one error line naming
    `moe-serve plan --gpu cpu --calibrate`, and nothing is measured (measuring runs engines on every core)."""
    from moe_runtime.planner.calibration import cpu_calibration

    def must_not_measure(*args):
        raise AssertionError("planning measured this machine")

    monkeypatch.setattr(cpu_calibration, "measure_rates", must_not_measure)
    monkeypatch.setattr(cpu_calibration, "measure_overheads", must_not_measure)
    monkeypatch.setattr(cpu_calibration, "CACHE", tmp_path / "none.json")
    with pytest.raises(cpu_calibration.CpuNotCalibratedError, match="moe-serve plan --gpu cpu --calibrate"):
        cpu_calibration.cpu_hardware(path=tmp_path / "none.json")
    monkeypatch.setattr("moe_runtime.server.plan_cli.cpu_hardware",
                        lambda: cpu_calibration.cpu_hardware(path=tmp_path / "none.json"))
    with pytest.raises(SystemExit) as refused:
        cli_main(["plan", "--model", str(LLAMA_70B), "--gpu", "cpu", "--prompt-len", "64", "--output-len", "16",
                  "--concurrency", "4"])
    assert refused.value.code == 2
    assert "--gpu cpu --calibrate" in capsys.readouterr().err


def test_calibrate_measures_on_request_and_only_for_cpu(tmp_path, monkeypatch, capsys):
    from moe_runtime.planner.calibration import cpu_calibration
    from moe_runtime.planner.calibration.cpu_calibration import CpuRates

    measured = []
    fresh = CpuRates("here", 2, 1e10, 2e10, 1e-5)
    monkeypatch.setattr(cpu_calibration, "measure_rates", lambda: measured.append("rates") or fresh)
    monkeypatch.setattr(cpu_calibration, "measure_overheads", lambda rates: None)
    cache = tmp_path / "calibration.json"
    monkeypatch.setattr("moe_runtime.server.plan_cli.cached_calibration",
                        lambda refresh: cpu_calibration.cached_calibration(cache, refresh=refresh))
    assert cli_main(["plan", "--gpu", "cpu", "--calibrate"]) == 0
    assert measured == ["rates"] and "calibrated here (2 cores)" in capsys.readouterr().err
    assert cpu_calibration.recorded_calibration(cache) == (fresh, None)    # what later plans read
    with pytest.raises(SystemExit) as refused:
        cli_main(["plan", "--gpu", "h100", "--calibrate"])
    assert refused.value.code == 2 and "--gpu cpu" in capsys.readouterr().err
    assert measured == ["rates"]


def test_the_plan_states_the_whole_models_weights_and_kv_bytes_per_token(capsys):
    """The numbers the planning question starts from, in the header and in --json (issue: Llama-3.1-70B's
    320 KiB per token in bf16; DeepSeek-V3's MLA latent, 61 layers x (512 + 64) x 2 bytes)."""
    args = ["--gpu", "h100", "--prompt-len", "2048", "--output-len", "512", "--concurrency", "64", "--dtype",
            "bfloat16"]
    llama = _plan_json(capsys, "--model", str(LLAMA_70B), *args)
    assert llama["kv_bytes_per_token"] == 320 * 1024 and llama["windowed_kv_bytes_per_token"] == 0
    assert round(llama["weight_bytes"] / 1e9) == 141
    deepseek = _plan_json(capsys, "--model", str(DEEPSEEK_V3), *args)
    assert deepseek["kv_bytes_per_token"] == 61 * (512 + 64) * 2
    assert round(deepseek["weight_bytes"] / 1e9) == round(load_model_shape(DEEPSEEK_V3).total_params * 2 / 1e9)
    assert cli_main(["plan", "--model", str(LLAMA_70B), *args]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header == "Whole model: weights 141.1 GB; KV cache 320.0 KiB per token in bfloat16"


def test_windowed_layers_are_stated_apart(tiny_configs, capsys):
    plan = _plan_json(capsys, "--model", str(tiny_configs["gpt_oss"]), "--gpu", "h100", "--prompt-len", "256",
                      "--output-len", "64", "--qps", "2")
    assert plan["kv_bytes_per_token"] > 0 and plan["windowed_kv_bytes_per_token"] > 0   # gpt-oss: sliding + full
