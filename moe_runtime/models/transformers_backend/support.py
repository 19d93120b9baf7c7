"""What the transformers backend cannot run, refused by name before anything is built.

Layouts that split a layer's heads or a stage's layers run where the model's tp_plan / pp_plan says how
(tensor_parallel.py, pipeline_stages.py) and are refused naming the plan otherwise; capturing the forward is
refused naming the flag; layers that keep a
recurrent state run where recurrent_state.py knows their state's shapes (recurrent_mixers.py) and are refused
naming the model type otherwise; other layer types transformers' attention does not cover are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.models.transformers_backend.own_cache_attention import check_own_cache, own_cache_layers
from moe_runtime.models.transformers_backend.pipeline_stages import pp_refusal
from moe_runtime.models.transformers_backend.tensor_parallel import tp_refusal
from moe_runtime.models.transformers_backend.recurrent_state import served_layout
from moe_runtime.config.speculative import MODEL_DRAFTERS, SpeculativeConfig

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
MIXERLESS_LAYER_TYPES = frozenset({"moe", "mlp"})   # Nemotron-H's blocks without a token mixer

# --quantization the backend serves: the routed experts kept quantized in our stacks (quantized at load from the
# float weights transformers loaded); attention, dense MLPs and routers stay in --dtype
EXPERT_QUANTIZATIONS = (None, "none", "int8", "fp8")


def transformers_class(architecture: str):
    """transformers' class named `architecture` (config.json `architectures[0]`), a causal LM."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None or not architecture.endswith("ForCausalLM"):
        raise UnsupportedArchitectureError(
            f"transformers backend: transformers {transformers.__version__} has no causal LM class "
            f"{architecture!r} (config.json 'architectures')")
    return cls


@dataclass(frozen=True)
class RowPositions:
    """A module that computes positions from its row (arange over the tokens + its cache length) instead of
    reading position_ids: in a step packed as one row of several sequences (no transformers cache) those
    positions are wrong, so a config that turns it on is refused. One entry per such module, with the config
    switch that turns it on."""

    model_types: frozenset[str]
    active: Callable[[object], bool]
    what: str


ROW_POSITIONS = (
    RowPositions(frozenset({"llama4_text", "llama4"}),
                 lambda cfg: bool(getattr(cfg, "attn_temperature_tuning", False))
                 and 0 in (getattr(cfg, "no_rope_layers", None) or []),
                 "Llama4TextAttention's query temperature on its NoPE layers (attn_temperature_tuning)"),
)


def check_config(architecture: str, hf_config) -> None:
    model_type = getattr(hf_config, "model_type", None)
    for entry in ROW_POSITIONS:
        if model_type in entry.model_types and entry.active(hf_config):
            raise UnsupportedArchitectureError(
                f"transformers backend: {architecture} runs {entry.what}, which counts positions along its row "
                "rather than reading position_ids; a step packs several sequences into one row")
    layer_types = getattr(hf_config, "layer_types", None) or []
    layout = served_layout(hf_config)   # recurrent layers: kept in state slots (recurrent_mixers.py), or refused
    stateful = set(layout.layer_indices if layout else ())
    check_own_cache(architecture, hf_config)   # layers run with transformers' cache and mask, per sequence
    stateful |= set(own_cache_layers(hf_config))
    other = sorted({t for i, t in enumerate(layer_types)
                    if t not in ATTENTION_LAYER_TYPES | MIXERLESS_LAYER_TYPES and i not in stateful})
    if other:
        first = next(i for i, t in enumerate(layer_types) if t in other)
        raise UnsupportedArchitectureError(
            f"transformers backend: {architecture} has layers of type {', '.join(repr(t) for t in other)} (first: "
            f"layer {first}), which the backend does not run")


def check_engine(architecture: str, pp: int, attn_tp: int, cp: int, quantization: str | None,
                 engine: EngineConfig | None) -> None:
    """EngineConfigError naming every flag the backend cannot run with: asked at the front before any rank starts
    (`refuse_before_launch`) and again on each rank as the model is built."""
    refusals = []
    refusals += [r for r in (pp_refusal(architecture, pp), tp_refusal(architecture, attn_tp)) if r]   # their plans
    if cp > 1:
        refusals.append(f"--cp {cp}")
    if quantization not in EXPERT_QUANTIZATIONS:
        refusals.append(f"--quantization {quantization} (the routed experts can be kept int8 or fp8; the rest runs "
                        "in --dtype)")
    if engine is not None:
        if engine.enable_torch_compile:
            refusals.append("--enable-torch-compile (the decode capture traces the native layers)")
        if engine.deterministic:
            refusals.append("--deterministic (transformers' matmuls are not the batch-invariant kernels)")
        speculative = SpeculativeConfig.parse(engine.speculative_config)
        if speculative is not None and speculative.method in MODEL_DRAFTERS:
            refusals.append(f"speculative method {speculative.method!r} (a model drafter reads native layers)")
    if refusals:
        raise EngineConfigError(f"transformers backend ({architecture}) cannot run: " + "; ".join(refusals))
