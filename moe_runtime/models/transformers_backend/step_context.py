"""What transformers' attention calls need from the engine during one forward, hung on the modules.

transformers calls an attention implementation as `fn(module, query, key, value, mask, **kwargs)`: nothing of
our step reaches it but the module. The wrapper therefore hangs one `StepContext` on every module that has a
`layer_idx` (attention modules, decoder layers) when the model is built, and fills it before each forward: the
step's `AttentionBatch` and the paged caches of this stage's layers. The attention function reads
`module.moe_runtime_step` and finds its layer's cache by `module.layer_idx`. One object per model, no module
globals: two models in one process (a drafter beside its target) keep their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.attention_backend import AttentionKernels
from moe_runtime.layers.attention_span import AttentionSpan
from moe_runtime.layers.kv_cache import LayerKVCache

STEP_ATTRIBUTE = "moe_runtime_step"


@dataclass
class LayerAttention:
    """One layer's attention as the KV cache spec declared it: what transformers must agree with at run time."""

    span: AttentionSpan
    num_kv_heads: int
    key_dim: int
    value_dim: int
    config_error: str | None = None   # the config did not tell the shapes (probe.py must see them)


@dataclass
class StepContext:
    """The step being run (`batch`, `caches`: set by the wrapper around each forward, None outside one)."""

    attention: AttentionKernels                   # the paged decode and varlen prefill kernels of the family
    layers: list[LayerAttention]                  # by global layer index
    batch: AttentionBatch | None = None
    caches: list[LayerKVCache] | None = None      # by global layer index
    # A rank with no tokens this step (an idle DP attention worker) still runs every MoE layer's collectives:
    # the wrapper runs transformers' modules on one stand-in token (their reshapes cannot take an empty row),
    # attention then writes and reads nothing and the experts hand the executor no rows; the output is dropped.
    stand_in: bool = False
    # The KV shape probe (probe.py): layer -> what its attention was handed; set only during the probe forward.
    probe: dict | None = None
    checked: set[int] = field(default_factory=set)   # layers whose shapes were checked against their spec once

    def cache_of(self, layer: int) -> LayerKVCache:
        if self.caches is None or self.batch is None:
            raise RuntimeError("transformers' attention ran outside a step of the moe_runtime wrapper "
                               "(TransformersCausalLM.forward sets the step)")
        return self.caches[layer]


def hang_step_context(model: nn.Module, step: StepContext) -> int:
    """Set `step` on every module of `model` with an integer `layer_idx`; returns how many. A plain attribute:
    `StepContext` is no module, so it adds nothing to the parameters or the state dict."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            object.__setattr__(module, STEP_ATTRIBUTE, step)
            count += 1
    return count
