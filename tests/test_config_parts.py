"""EngineConfig in parts: every setting is defined in exactly one part, the flat names (`config.block_size`,
`EngineConfig(ep=2)`, `LLM(path, block_size=8)`, the `moe-serve` flags, the msgpack form the ranks receive)
keep working, parts round-trip, and a bad value is refused by its part with the flag named."""
from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

import moe_runtime.front.llm as llm_module
from moe_runtime.config.cache_settings import CacheSettings
from moe_runtime.config.engine_config import SETTINGS_PARTS, EngineConfig, EngineConfigError
from moe_runtime.config.model_settings import ModelSettings
from moe_runtime.config.parallel_settings import ParallelSettings
from moe_runtime.config.scheduler_settings import SchedulerSettings
from moe_runtime.config.serving_settings import ServingSettings
from moe_runtime.config.speculative_settings import SpeculativeSettings
from moe_runtime.front.llm import LLM
from moe_runtime.server.cli import build_parser, engine_config_from_args

# The flat keyword names, part by part: written out so that a setting dropped, renamed or moved fails here.
FLAT_NAMES = {
    ModelSettings: ("model", "device", "dtype", "max_model_len", "kernels", "model_impl", "quantization",
                    "logprobs_mode", "deterministic", "enable_torch_compile", "torch_compile_max_bs",
                    "torch_compile_backend", "torch_compile_wrapper", "debug_host_reads"),
    CacheSettings: ("block_size", "kv_cache_memory", "enable_prefix_caching", "kv_host_memory", "kv_disk_dir",
                    "kv_disk_size"),
    ParallelSettings: ("ep", "dp_attn", "tp", "pp", "pp_layers", "pp_micro_batches", "cp", "a2a_backend",
                       "dispatch_fp8", "deepep_module", "enable_two_batch_overlap", "num_redundant_experts",
                       "cpu_experts", "device_resident_experts", "eplb_interval", "eplb_threshold", "eplb_window",
                       "eplb_layers_per_step"),
    SchedulerSettings: ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "cache_aware_routing"),
    SpeculativeSettings: ("speculative_config",),
    ServingSettings: ("master_addr", "master_port", "nnodes", "node_rank", "control_port", "launch_workers",
                      "control_key_file", "worker_timeout_s", "control_heartbeat_timeout_s", "max_rank_restarts",
                      "disaggregation_mode", "kv_transfer_host", "kv_transfer_key_file", "kv_transfer_timeout_s",
                      "grammar_compile_timeout_s", "structured_output_any_whitespace"),
}
# Settings `LLM` takes that have no `moe-serve` flag (tuning and debugging knobs).
LLM_ONLY = {"eplb_layers_per_step", "eplb_threshold", "eplb_window", "pp_layers", "pp_micro_batches",
            "torch_compile_backend", "torch_compile_wrapper", "worker_timeout_s"}


def _not_default(field: dataclasses.Field):
    """A value of the field's type other than its default (not checked: construction does not validate)."""
    special = {"model": "/some/checkpoint", "pp_layers": (3, 5), "max_model_len": 77, "kv_disk_dir": "/tmp/tier",
               "quantization": "int8", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
               "master_port": 29400, "control_port": 29401, "control_key_file": "/k", "kv_transfer_key_file": "/t",
               "control_heartbeat_timeout_s": 5.0}
    if field.name in special:
        return special[field.name]
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    return default + "-other"


ALL_CHANGED = {f.name: _not_default(f) for f in dataclasses.fields(EngineConfig)}


def test_each_setting_is_defined_in_exactly_one_part():
    part_names = {part: tuple(f.name for f in dataclasses.fields(part)) for part in SETTINGS_PARTS}
    assert part_names == FLAT_NAMES
    flat = [f.name for f in dataclasses.fields(EngineConfig)]
    assert flat == [name for part in SETTINGS_PARTS for name in part_names[part]]   # nothing beside the parts
    assert len(flat) == len(set(flat))
    for part in SETTINGS_PARTS:   # the part's definition (default and type) is the flat field's
        flat_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        for f in dataclasses.fields(part):
            assert (flat_fields[f.name].default, flat_fields[f.name].type) == (f.default, f.type), f.name


def test_every_flat_keyword_reaches_the_config_and_its_part():
    config = EngineConfig(**ALL_CHANGED)
    for name, value in ALL_CHANGED.items():
        assert getattr(config, name) == value, name
    parts = {ModelSettings: config.model_settings, CacheSettings: config.cache_settings,
             ParallelSettings: config.parallel_settings, SchedulerSettings: config.scheduler_settings,
             SpeculativeSettings: config.speculative_settings, ServingSettings: config.serving_settings}
    for part_class, part in parts.items():
        assert type(part) is part_class
        assert dataclasses.asdict(part) == {name: ALL_CHANGED[name] for name in FLAT_NAMES[part_class]}
    assert EngineConfig("m", ep=2).ep == 2 and EngineConfig("m").model == "m"   # model stays the first positional


def test_llm_accepts_every_flat_keyword(monkeypatch):
    """`LLM(path, **flat keywords)` builds the EngineConfig it hands the engine factory (stubbed: no model loads)."""
    built = []
    monkeypatch.setattr(llm_module, "make_engine", lambda config: built.append(config))
    keywords = {name: value for name, value in ALL_CHANGED.items() if name != "model"}
    llm = LLM("/some/checkpoint", **keywords)
    assert built == [EngineConfig(**ALL_CHANGED)] and llm.config is built[0]
    with pytest.raises(TypeError, match="cache_settings"):   # parts go through EngineConfig.from_parts
        LLM("/some/checkpoint", cache_settings=CacheSettings())


def test_cli_flags_fill_the_parts(tmp_path):
    defaults = vars(build_parser().parse_args([]))
    engine_names = {name for names in FLAT_NAMES.values() for name in names} - {"model"}
    assert engine_names - defaults.keys() == LLM_ONLY   # every other setting keeps its flag
    args = build_parser().parse_args([
        "--model", str(tmp_path), "--model-impl", "transformers", "--block-size", "8", "--kv-disk-dir", "/d",
        "--kv-disk-size", "1GiB", "--ep", "4", "--dp-attn", "2", "--max-num-seqs", "7", "--no-cache-aware-routing",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "--grammar-compile-timeout", "2.5"])
    config = engine_config_from_args(args)
    assert (config.model_settings.model_impl, config.cache_settings.block_size) == ("transformers", 8)
    assert (config.cache_settings.kv_disk_dir, config.cache_settings.kv_disk_size) == ("/d", 2**30)
    assert (config.parallel_settings.ep, config.parallel_settings.dp_attn, config.world_size) == (4, 2, 4)
    assert config.scheduler_settings == SchedulerSettings(max_num_seqs=7, cache_aware_routing=False)
    assert config.speculative_settings.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    serving = config.serving_settings
    assert (serving.nnodes, serving.node_rank, serving.master_port, serving.grammar_compile_timeout_s) == \
        (2, 1, 29500, 2.5)


def test_parts_round_trip():
    config = EngineConfig(**ALL_CHANGED)
    rebuilt = EngineConfig.from_parts(config.model_settings, cache_settings=config.cache_settings,
                                      parallel_settings=config.parallel_settings,
                                      scheduler_settings=config.scheduler_settings,
                                      speculative_settings=config.speculative_settings,
                                      serving_settings=config.serving_settings)
    assert rebuilt == config
    partial = EngineConfig.from_parts(ModelSettings("m", dtype="bf16"), cache_settings=CacheSettings(block_size=8))
    assert partial == EngineConfig("m", dtype="bf16", block_size=8)   # parts left out keep their defaults
    part = config.cache_settings
    part.block_size = 1
    assert config.block_size == ALL_CHANGED["block_size"]   # a part is a copy of the values
    assert dataclasses.replace(config, ep=9).parallel_settings.ep == 9


def test_the_wire_form_is_the_flat_map():
    """The ranks receive the config in msgpack: one map of the flat names, decoded back to an equal config."""
    config = EngineConfig(**ALL_CHANGED)
    encoded = msgspec.msgpack.encode(config)
    assert set(msgspec.msgpack.decode(encoded)) == set(ALL_CHANGED)
    assert msgspec.msgpack.decode(encoded, type=EngineConfig) == config


@pytest.mark.parametrize(("part", "message"), [
    (ModelSettings("m", model_impl="mine"), "--model-impl 'mine'"),
    (ModelSettings("m", quantization="fp4"), "--quantization fp4"),
    (ModelSettings("m", logprobs_mode="odd"), "--logprobs-mode 'odd'"),
    (ModelSettings("m", enable_torch_compile=True, torch_compile_max_bs=0), "--torch-compile-max-bs 0"),
    (CacheSettings(block_size=0), "--block-size 0"),
    (CacheSettings(kv_disk_size=2**30), "--kv-disk-size needs --kv-disk-dir"),
    (CacheSettings(kv_host_memory=2**20, enable_prefix_caching=False), "need --enable-prefix-caching"),
    (ParallelSettings(dispatch_fp8=True), "--dispatch-fp8 needs --ep > 1"),
    (ParallelSettings(device_resident_experts=2), "--device-resident-experts 2 needs --cpu-experts"),
    (ParallelSettings(ep=2, cp=2, enable_two_batch_overlap=True), "--cp 2 with --enable-two-batch-overlap"),
    (SchedulerSettings(max_num_seqs=0), "--max-num-seqs 0"),
    (SchedulerSettings(max_num_batched_tokens=0), "--max-num-batched-tokens 0"),
    (ServingSettings(nnodes=2, master_port=1, node_rank=2), "--node-rank 2 must be < --nnodes 2"),
    (ServingSettings(nnodes=2), "--nnodes 2 needs --master-port"),
    (ServingSettings(disaggregation_mode="both"), "--disaggregation-mode 'both'"),
    (ServingSettings(grammar_compile_timeout_s=0.0), "--grammar-compile-timeout 0.0"),
])
def test_a_bad_value_is_refused_by_its_part_naming_the_flag(part, message):
    with pytest.raises(EngineConfigError, match=message):
        part.validate()
    config = EngineConfig.from_parts(part) if isinstance(part, ModelSettings) else EngineConfig.from_parts(
        ModelSettings("m"), **{_keyword(part): part})
    with pytest.raises(EngineConfigError, match=message):   # the flat config runs the part's checks
        config.validate_options()


def test_bad_speculative_settings_name_the_key():
    with pytest.raises(Exception, match="nonsense"):
        SpeculativeSettings({"method": "ngram", "num_speculative_tokens": 2, "nonsense": 1}).validate()


def test_the_layout_checks_stay_with_the_full_validation():
    """`--dp-attn` must divide `--ep`: `validate()` refuses it; `LLM`'s option checks leave it to
    `ParallelLayout.validate`, which names the values that would work once the checkpoint is read."""
    config = EngineConfig("m", device="cpu", ep=3, dp_attn=2)
    config.validate_options()
    with pytest.raises(EngineConfigError, match="--dp-attn 2 must divide --ep 3"):
        config.validate()


def test_from_parts_refuses_a_part_in_the_wrong_place():
    with pytest.raises(EngineConfigError, match="cache_settings takes a CacheSettings, not SchedulerSettings"):
        EngineConfig.from_parts(ModelSettings("m"), cache_settings=SchedulerSettings())


def test_a_cross_part_check_names_both_flags():
    config = EngineConfig.from_parts(ModelSettings("m", enable_torch_compile=True),
                                     parallel_settings=ParallelSettings(cp=2, ep=2))
    with pytest.raises(EngineConfigError, match="--enable-torch-compile with --ep 2"):
        config.validate_options()


def _keyword(part) -> str:
    return type(part).__name__.removesuffix("Settings").lower() + "_settings"
