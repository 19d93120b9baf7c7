"""No option is silently ignored: every option x architecture pair of docs/design.md's table is what the rules
(`front/model_options.py`) say, and every refused pair is refused by `LLM(...)` naming the option and the model
before any weight loads. The pairs that run are run by the architectures' own tests (captured decode:
test_captured_decode.py, test_attention_variants.py; host experts: test_cpu_native_experts.py,
test_cpu_experts_offload.py; two-batch overlap: test_two_batch_overlap*.py; fp8/int8/mxfp4: test_fp8*.py,
test_int8_weights.py, test_int4_weights.py, test_gpt_oss.py, test_deepseek_v4_release.py)."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from option_table_source import configs_of_every_architecture

from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.front.model_options import OPTION_RULES, ModelTraits, check_options_for_model, option_table
from moe_runtime.models.registry import supported_architectures

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
OPTIONS = {   # the rule's option -> the LLM keywords that ask for it
    "--enable-torch-compile": dict(enable_torch_compile=True),
    "--cpu-experts": dict(cpu_experts=True),
    "--enable-two-batch-overlap": dict(enable_two_batch_overlap=True),
    "--quantization mxfp4": dict(quantization="mxfp4"),
    "--quantization fp8": dict(quantization="fp8"),
    "--quantization int8": dict(quantization="int8"),
    "--quantization int4": dict(quantization="int4"),
}


@pytest.fixture(scope="module")
def configs():
    return configs_of_every_architecture()


def test_the_design_table_is_the_rules(configs):
    assert set(configs) == set(supported_architectures())   # every architecture the registry builds
    text = DESIGN.read_text()
    shown = re.search(r"<!-- option-table:begin -->\n(.*?)\n<!-- option-table:end -->", text, re.S).group(1)
    assert shown == option_table([ModelTraits.of_config(c) for c in configs.values()]), \
        "docs/design.md's option table is stale: regenerate it from model_options.option_table"
    assert set(OPTIONS) == {rule.option for rule in OPTION_RULES}


def test_every_pair_is_refused_by_name_exactly_where_the_table_says(configs):
    for architecture, hf_config in configs.items():
        model = ModelTraits.of_config(hf_config)
        for rule in OPTION_RULES:
            config = EngineConfig(model="unused", **OPTIONS[rule.option])
            why = rule.refusal(model)
            if why is None:
                check_options_for_model(config, hf_config)
            else:
                with pytest.raises(EngineConfigError, match=re.escape(f"{rule.option} with {architecture}: {why}")):
                    check_options_for_model(config, hf_config)


@pytest.mark.parametrize("arch, option", [("llama", "--cpu-experts"), ("qwen2", "--enable-two-batch-overlap"),
                                          ("mistral", "--quantization mxfp4"), ("qwen3_next", "--enable-torch-compile"),
                                          ("deepseek_v4", "--quantization fp8")])
def test_llm_refuses_before_loading_anything(tiny_checkpoint_factory, arch, option):
    """Through the real entry point, on saved checkpoints: the refusal comes from make_engine."""
    with pytest.raises(EngineConfigError, match=re.escape(option) + r" with \w+ForCausalLM: "):
        LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", **OPTIONS[option])


def test_the_start_up_log_and_the_stats_say_which_steps_are_captured(tiny_checkpoint_factory, caplog):
    """Asked for and allowed, the captured step says so at start-up and its steps are counted (/metrics:
    moe_captured_decode_steps, from these worker stats)."""
    from engine_helpers import PROMPTS, greedy

    with caplog.at_level("INFO"), LLM(str(tiny_checkpoint_factory("llama")), device="cpu", dtype="float32",
                                      enable_torch_compile=True, torch_compile_backend="eager") as llm:
        llm.generate(PROMPTS[:1], greedy(6))
        captured = llm.engine.stats().workers[0].captured_decode_steps
    assert "captured decode: pure decode steps of up to 32 rows" in caplog.text
    assert captured == 5   # every decode step after the prefill


@pytest.mark.parametrize("architecture, refused", [("GptOssForCausalLM", True), ("MixtralForCausalLM", False)])
def test_int4_kept_by_itself_answers_to_the_int4_rule_without_naming_a_flag_not_given(configs, architecture, refused):
    """Review of issue 52, #9: an int4 release with --quantization unset skipped the option table, and was refused
    later naming --quantization int4, which the user never passed."""
    hf_config = copy.deepcopy(configs[architecture])
    hf_config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    if not refused:
        check_options_for_model(EngineConfig(model="unused"), hf_config)
        return
    with pytest.raises(EngineConfigError, match=f"{architecture} release with its routed experts stored in int4.*"
                                                "--quantization none to serve them dequantized") as refusal:
        check_options_for_model(EngineConfig(model="unused"), hf_config)
    assert "--quantization int4" not in str(refusal.value)
    check_options_for_model(EngineConfig(model="unused", quantization="none"), hf_config)   # served in --dtype
