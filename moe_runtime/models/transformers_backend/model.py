"""The engine's causal LM over a transformers model (the surface models/decoder.CausalLM offers the engine).

`forward` runs transformers' base model on the step packed as one row of T tokens (input_ids [1, T],
position_ids = the step's positions), after setting the step on the modules' `StepContext`: attention goes to
our paged kernels (attention.py), routed experts to the executor (experts.py), everything else is transformers'
own code. `logits` runs transformers' own causal-LM head on given hidden states (`_head_logits`), so whatever
the class does after its decoder (Gemma's final soft-cap, a logit scale) is applied as transformers applies it.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_span import SLIDING
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.models.transformers_backend.experts import ExpertsSeam
from moe_runtime.models.transformers_backend.kv_specs import kv_cache_spec
from moe_runtime.models.transformers_backend.loading import load_transformers_weights
from moe_runtime.models.transformers_backend.probe import probe_layers
from moe_runtime.models.transformers_backend.recurrent_state import served_layout
from moe_runtime.models.transformers_backend.step_context import StepContext
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.weights.loading import SkippedTensors


def decoder_attribute(hf: nn.Module) -> str:
    """The attribute under which a causal LM holds the base model its forward calls: `base_model_prefix` where
    that names one (most classes), else `model` (Llama4ForCausalLM's prefix is "language_model", its attribute
    `model`)."""
    for name in (hf.base_model_prefix, "model"):
        if isinstance(getattr(hf, name, None), nn.Module):
            return name
    raise UnsupportedArchitectureError(f"transformers backend: {type(hf).__name__} holds no base model under "
                                       f"{hf.base_model_prefix!r} or 'model'")


class TransformersExpertWeights(ExpertWeights):
    """This rank's experts of one transformers experts module: filled from the module's loaded stacks by
    `ExpertsSeam.take_weights` (the checkpoint's names are transformers' to map), so loading reads nothing here."""

    def load_weights(self, reader, prefix: str) -> set[str]:
        return {name for name, _ in self.named_parameters()}


class HiddenStates(nn.Module):
    """Stands in for the base model while transformers' head runs: returns the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden                                                    # [1, B, H]

    def forward(self, *args, **kwargs) -> "BaseOutput":
        return BaseOutput(self.hidden)


class BaseOutput:
    """What a causal LM's forward reads of its base model's output: the hidden states; any other field (MoE
    models' router_logits, past_key_values, ...) is None, as a forward without those outputs gives."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getattr__(self, name: str):
        return None

    def __getitem__(self, index: int):
        return (self.last_hidden_state,)[index]


class TransformersModel(nn.Module):
    """Holds the transformers causal LM; `load_weights` fills all of it through transformers' loading rules (the
    engine's loader calls it, then finds every parameter under it loaded). Its tensors are every checkpoint name
    (`checkpoint_prefix`, what a weight update matches the names it carries against)."""

    checkpoint_prefix = ""

    def __init__(self, hf_model: nn.Module, seams: list[tuple[str, ExpertsSeam]], device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.hf = hf_model
        self.seams = seams                     # (experts module name in hf, its seam), in model order
        self.device, self.dtype = device, dtype
        self.shapes = {name: (p.shape, p.dtype) for name, p in hf_model.named_parameters()}
        self.skipped = SkippedTensors()

    def load_weights(self, reader, prefix: str) -> set[str]:
        names = {f"hf.{name}" for name in self.shapes}
        load_transformers_weights(self.hf, reader, self.skipped, self.device, self.dtype,
                                  [name for name, _ in self.seams], self.shapes)
        for name, seam in self.seams:
            seam.take_weights(self.hf.get_submodule(name), reader)
        self.hf.eval()
        return names


class TransformersCausalLM(nn.Module):
    def __init__(self, hf_config, backbone: TransformersModel, routed: list[TransformersExpertWeights],
                 step: StepContext, executor: MoEExecutor):
        super().__init__()
        self.hf_config = hf_config
        self.backbone = backbone                           # first: the engine's loader fills it before the experts
        self.routed_experts = nn.ModuleList(routed)
        self.step = step
        self.executor = executor
        self.aux_layers: tuple[int, ...] = ()              # no EAGLE-3 head reads this model's layers
        self.aux_hidden: torch.Tensor | None = None
        self.first_layer = 0
        self._probed = False                               # the KV shape probe ran (kv_cache_specs)
        self.num_layers = len(step.layers)

    @property
    def model(self) -> nn.Module:
        """transformers' base model (its `embed_tokens` is what the engine reads of a model's embedding)."""
        hf = self.backbone.hf
        return getattr(hf, decoder_attribute(hf))

    def min_sliding_window(self) -> int | None:
        windows = [layer.span.size for layer in self.step.layers if layer.span.kind == SLIDING]
        return min(windows, default=None)

    def stage_activation_width(self) -> int:
        return self.hf_config.hidden_size

    def kv_cache_specs(self) -> list:
        """Each layer's paged KV cache spec, or its state slot's (`StateSpec`) where it keeps a recurrent state."""
        if not self._probed:   # the modules' own KV shapes, once the weights are in (probe.py)
            self._probed = True
            probe_layers(lambda ids, positions: self.model(input_ids=ids, position_ids=positions, use_cache=False),
                         self.step, self.backbone.device)
        specs = [kv_cache_spec(layer) for layer in self.step.layers]
        layout = served_layout(self.hf_config)
        return specs if layout is None else layout.with_state_specs(specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                caches: list[LayerKVCache], hidden: torch.Tensor | None = None) -> torch.Tensor:  # [T] -> [T, H]
        """Final hidden states (the base model's last_hidden_state, its final norm applied)."""
        step = self.step
        step.batch, step.caches, step.stand_in = batch, caches, input_ids.numel() == 0
        if step.stand_in:   # an idle rank: one stand-in token through every layer's collectives, then dropped
            input_ids, positions = input_ids.new_zeros(1), positions.new_zeros(1)
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            step.batch = step.caches = None
        hidden = out.last_hidden_state[0]                                       # [T, H]
        return hidden[:0] if step.stand_in else hidden

    def drafter_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        return self._head_logits(hidden)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V] fp32
        """transformers' causal-LM forward over `hidden`, the base model swapped for `HiddenStates` meanwhile."""
        hf = self.backbone.hf
        prefix = decoder_attribute(hf)
        base = getattr(hf, prefix)
        setattr(hf, prefix, HiddenStates(hidden[None]))
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = hf(input_ids=ids, use_cache=False, logits_to_keep=0)
        finally:
            setattr(hf, prefix, base)
        return out.logits[0].float()                                            # [B, V]
