"""Pipeline stages for the transformers backend, from the model's own pp_plan.

transformers' classes that can be pipelined declare their stage modules (`config.base_model_pp_plan`:
embed_tokens takes input_ids, the layers pass hidden_states on, norm ends the stack; the class adds lm_head).
A stage keeps the decoder layers [first, last) the engine gave it (`ParallelContext.stage_layers`); the others
become `PassThroughLayer`s that keep the layer indices (as models/decoder.MissingLayer does for native models)
and return the hidden states they are handed. The first stage keeps the embedding, the last the final norm and
the LM head (and the embedding too when tied to the head); the others get pass-throughs, so the base model's
forward runs unchanged and its `last_hidden_state` is the last layer's output.

Activations follow the engine's pipeline contract (execution/pipeline.py): a non-first stage gets the previous
stage's [T, H] `hidden`; it enters at this stage's first layer (`StageInput`, a forward pre-hook on that layer),
so whatever the base model does between the embedding and the first layer (a scaled embedding) is not applied
twice; the embedding stand-in gives zeros of the right shape meanwhile.

A pp request for a model without a base_model_pp_plan, or whose plan names stage modules other than these, is
refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.weights.loading import SkippedTensor

STAGE_MODULES = frozenset({"embed_tokens", "layers", "norm"})


class PassThroughLayer(nn.Module):
    """Stands for a decoder layer another stage holds: returns its hidden states unchanged."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class PassThroughNorm(nn.Module):
    """Stands for the final norm on a stage that is not the last: its output is the stage's activations."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class ZeroEmbedding(nn.Module):
    """Stands for the embedding on a stage that is not the first: [1, T] ids -> zeros [1, T, H] (the stage's input
    replaces them at its first layer)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.hidden_size, dtype=self.dtype, device=ids.device)


@dataclass
class StageInput:
    """The previous stage's activations, put in place of the hidden states entering this stage's first layer."""

    hidden: torch.Tensor | None = None                                          # [T, H] while a forward runs

    def before_first_layer(self, module, args, kwargs):
        if self.hidden is None:
            raise RuntimeError("transformers backend: a non-first pipeline stage ran without its input activations")
        incoming = self.hidden[None].to(self._dtype(args, kwargs))             # [1, T, H]
        if args:
            return (incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": incoming}

    @staticmethod
    def _dtype(args, kwargs) -> torch.dtype:
        return (args[0] if args else kwargs["hidden_states"]).dtype


@dataclass
class PipelineStage:
    """This rank's stage of the model: its layers, and the checkpoint prefixes other stages load."""

    first: int
    last: int
    is_first: bool
    is_last: bool
    dropped: list[str] = field(default_factory=list)     # module names (in the causal LM) replaced by stand-ins
    input: StageInput = field(default_factory=StageInput)

    def owns(self, layer: int) -> bool:
        return self.first <= layer < self.last

    def skip_rule(self, renamed: dict[str, str]) -> SkippedTensor | None:
        """A rule skipping the checkpoint tensors (by name; `renamed`: checkpoint name -> the model's name under
        transformers' conversion rules) that fill the modules this stage dropped; another stage reads them."""
        prefixes = tuple(f"{name}." for name in self.dropped)
        names = sorted(name for name, model_name in renamed.items() if model_name.startswith(prefixes))
        if not names:
            return None
        return SkippedTensor("^(" + "|".join(re.escape(n) for n in names) + ")$",
                             f"pipeline stage with layers [{self.first}, {self.last}): another stage loads them")


def _refuse(architecture: str, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"transformers backend ({architecture}): pipeline parallelism: {what}")


def keep_stage(architecture: str, hf: nn.Module, stage_layers: tuple[int, int], is_first: bool, is_last: bool,
               dtype: torch.dtype) -> PipelineStage:
    """Replace the modules of the meta-built causal LM `hf` that other stages hold (see the module doc)."""
    config = hf.config
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise _refuse(architecture, f"{type(config).__name__} has no base_model_pp_plan (transformers does not say "
                                    "which modules form its stages); run it with --pp 1")
    other = sorted(set(plan) - STAGE_MODULES)
    if other or set(plan) != STAGE_MODULES:
        raise _refuse(architecture, f"its base_model_pp_plan names {sorted(plan)}; the stages implemented are "
                                    f"{sorted(STAGE_MODULES)} exactly")
    prefix = hf.base_model_prefix
    base = getattr(hf, prefix)
    layers = base.layers
    if not isinstance(layers, nn.ModuleList) or len(layers) != config.num_hidden_layers:
        raise _refuse(architecture, f"{prefix}.layers is not a list of its {config.num_hidden_layers} layers")
    stage = PipelineStage(stage_layers[0], stage_layers[1], is_first, is_last)
    for index in range(len(layers)):
        if not stage.owns(index):
            layers[index] = PassThroughLayer(index)
            stage.dropped.append(f"{prefix}.layers.{index}")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if not is_first:
        layers[stage.first].register_forward_pre_hook(stage.input.before_first_layer, with_kwargs=True)
        if not (is_last and tied):   # the last stage keeps a tied embedding: it is the LM head's weight
            base.embed_tokens = ZeroEmbedding(config.hidden_size, dtype)
            stage.dropped.append(f"{prefix}.embed_tokens")
    if not is_last:
        base.norm = PassThroughNorm()
        stage.dropped.append(f"{prefix}.norm")
        if getattr(hf, "lm_head", None) is not None:
            hf.lm_head = nn.Identity()
            stage.dropped.append("lm_head")
        if tied:   # nothing left to tie on this stage
            hf.all_tied_weights_keys = {}
    return stage


def pp_refusal(architecture: str, pp: int) -> str | None:
    """Why `architecture` cannot run in `pp` stages, from its class's plan alone (the front asks before any rank
    starts; `keep_stage` finds the same on each rank); None: it can."""
    import transformers

    config_class = getattr(getattr(transformers, architecture, None), "config_class", None)
    if pp == 1 or config_class is None:
        return None
    plan = getattr(config_class, "base_model_pp_plan", None)
    if not plan:
        return f"--pp {pp} ({config_class.__name__} has no base_model_pp_plan)"
    if set(plan) != STAGE_MODULES:
        return f"--pp {pp} (its base_model_pp_plan names {sorted(plan)}; implemented: {sorted(STAGE_MODULES)})"
    return None
