"""Options that cannot apply to the served model are refused by name when the engine is configured.

An option that does nothing for a model misleads its user as much as a wrong answer: `--enable-torch-compile`
on a model with windowed KV groups used to log one line and decode eagerly, `--cpu-experts` on a dense model
held nothing on the host. `OPTION_RULES` is the one table of such refusals; `check_options_for_model` applies
it in `make_engine` (before any rank starts, for `LLM` and `moe-serve` alike), and `option_table` writes it
out for docs/design.md ("Options by model family"), which a test holds equal to the table.

What a model is, for these rules, is read from its config the way the planner reads it
(`planner.model_shape`: the registry's architectures, their MoE layers, windowed and linear-attention layers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.config.quantization_choice import kept_quantization
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.planner.int4_experts import COMPRESSED_TENSORS, INT4_METHODS
from moe_runtime.planner.model_shape import FULL, LINEAR, ModelShape, model_shape_of

GPT_OSS = "GptOssForCausalLM"
DEEPSEEK_V4 = "DeepseekV4ForCausalLM"


@dataclass(frozen=True)
class ModelTraits:
    """What the option rules ask of a model."""

    architecture: str
    moe: bool                      # routed experts (a dense model runs as one expert: nothing to route)
    windowed_beside_full: bool     # sliding or chunked layers keep KV groups of their own beside full ones
    linear_attention: bool         # layers with recurrent states instead of a KV cache

    @classmethod
    def of_shape(cls, shape: ModelShape) -> "ModelTraits":
        spans = {layer.span for layer in shape.layers}
        attention = spans - {LINEAR}
        return cls(shape.architecture, shape.num_experts > 1, FULL in attention and len(attention) > 1,
                   LINEAR in spans)

    @classmethod
    def of_config(cls, hf_config) -> "ModelTraits":
        return cls.of_shape(model_shape_of(hf_config.to_dict()))


@dataclass(frozen=True)
class OptionRule:
    """`option` (as `moe-serve` spells it) is refused for a model where `refusal` gives a reason."""

    option: str
    asked: Callable[[EngineConfig], bool]
    refusal: Callable[[ModelTraits], str | None]


def _capture_refusal(model: ModelTraits) -> str | None:
    if model.architecture == DEEPSEEK_V4:
        return "a captured step does not take its per-sequence compressor state yet"
    if model.linear_attention:
        return "its linear-attention layers keep recurrent states, which a captured step does not take yet"
    if model.windowed_beside_full:
        return "it keeps windowed KV cache groups beside the full one, whose block tables a captured step does " \
               "not take yet"
    return None


def _dense(what: str) -> Callable[[ModelTraits], str | None]:
    return lambda model: None if model.moe else f"a dense model has no routed experts to {what}"


def _mxfp4_refusal(model: ModelTraits) -> str | None:
    return _dense("hold in MXFP4")(model)


def _int4_refusal(model: ModelTraits) -> str | None:
    if model.architecture == GPT_OSS:
        return "its routed experts add biases and a clamped SwiGLU, which the int4 expert kernels (bias-free SiLU) " \
               "do not take; serve it as shipped (or --quantization mxfp4)"
    if model.architecture == DEEPSEEK_V4:
        return "its routed experts' clamped SiLU is not in the int4 expert kernels (bias-free SiLU); they ship in " \
               "FP4, which --quantization mxfp4 keeps as stored"
    return _dense("hold in int4")(model)


def _weight_quantization_refusal(model: ModelTraits) -> str | None:
    if model.architecture == GPT_OSS:
        return "its routed experts ship in MXFP4, and its attention sinks and biased projections have no FP8/int8 " \
               "kernels here; serve it as shipped (or --quantization mxfp4)"
    if model.architecture == DEEPSEEK_V4:
        return "not implemented for its compressed attention (its experts can be kept in FP4: --quantization mxfp4)"
    return None


OPTION_RULES = (
    OptionRule("--enable-torch-compile", lambda c: c.enable_torch_compile, _capture_refusal),
    OptionRule("--cpu-experts", lambda c: c.cpu_experts, _dense("keep in host memory")),
    OptionRule("--enable-two-batch-overlap", lambda c: c.enable_two_batch_overlap,
               _dense("dispatch, so there is no communication to overlap")),
    OptionRule("--quantization mxfp4", lambda c: c.quantization == "mxfp4", _mxfp4_refusal),
    OptionRule("--quantization fp8", lambda c: c.quantization == "fp8", _weight_quantization_refusal),
    OptionRule("--quantization int8", lambda c: c.quantization == "int8", _weight_quantization_refusal),
    OptionRule("--quantization int4", lambda c: c.quantization == "int4", _int4_refusal),
)
INT4_RULE = OPTION_RULES[-1]


def check_options_for_model(config: EngineConfig, hf_config) -> None:
    """EngineConfigError naming the first option asked for that the model cannot run, and why; int4 kept by itself
    (an int4 release's experts, `--quantization` unset: config/quantization_choice.py) answers to the same rule as
    an asked-for `--quantization int4`, in words that name the release, not a flag. An architecture the runtime
    does not serve is left to the model registry to refuse, in its own words."""
    asked = [rule for rule in OPTION_RULES if rule.asked(config)]
    automatic_int4 = config.quantization is None and int4_experts_declared(hf_config)
    if not asked and not automatic_int4:
        return
    try:
        shape = model_shape_of(hf_config.to_dict())
    except UnsupportedArchitectureError:
        return
    model = ModelTraits.of_shape(shape)
    for rule in asked:
        why = rule.refusal(model)
        if why is not None:
            raise EngineConfigError(f"{rule.option} with {model.architecture}: {why}")
    if kept_quantization(config, shape.int4_experts is not None).automatic:
        why = INT4_RULE.refusal(model)
        if why is not None:
            raise EngineConfigError(f"{model.architecture} release with its routed experts stored in int4, which "
                                    f"the engine keeps packed unless told otherwise: {why}; or pass --quantization "
                                    f"none to serve them dequantized in --dtype")


def int4_experts_declared(hf_config) -> bool:
    """A cheap look before the model's shape is read: config.json declares int4 weights of some kind."""
    quant = getattr(hf_config, "quantization_config", None)
    text = getattr(hf_config, "text_config", None)
    quant = quant or getattr(text, "quantization_config", None)
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else None
    return isinstance(quant, dict) and quant.get("quant_method") in (*INT4_METHODS, COMPRESSED_TENSORS)


def option_table(models: list[ModelTraits]) -> str:
    """OPTION_RULES as a markdown table: one row per architecture, one column per option ("refused" + reason
    in a footnote-free short form, or "runs")."""
    header = "| architecture | " + " | ".join(f"`{rule.option}`" for rule in OPTION_RULES) + " |"
    lines = [header, "|---" * (len(OPTION_RULES) + 1) + "|"]
    for model in sorted(models, key=lambda m: m.architecture):
        cells = []
        for rule in OPTION_RULES:
            why = rule.refusal(model)
            cells.append("runs" if why is None else f"refused: {why}")
        lines.append(f"| {model.architecture} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
