"""The KV shapes transformers' attention modules really compute, probed once with a stand-in token.

The config tells most models' KV heads and head sizes (kv_specs.py), but not every model's: DBRX keeps them in
attn_config, JetMoE's attention experts multiply its KV heads, MiMo-V2-Flash's sliding layers have their own,
Gemma 4 keeps a head size per layer type. So before the engine sizes its KV cache (the model's first
`kv_cache_specs`, after its weights are loaded) the wrapper runs transformers' modules once on one stand-in token
with `StepContext.probe` set: each attention call records the heads and sizes of the keys and values it was
handed, and is checked for what it cannot run (a dense mask, keyword arguments, bidirectional attention) so those
are refused as the engine starts, not at its first step; nothing is computed (attention and bound experts
return zeros, the executor is not called, so ranks need not pair up).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_span import SLIDING
from moe_runtime.models.transformers_backend.step_context import LayerAttention, StepContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbedAttention:
    """What one layer's attention call was handed."""

    module: str                   # its class, for messages
    num_kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None


def probe_layers(run, step: StepContext, device: torch.device) -> None:
    """Run `run(input_ids [1, 1], position_ids [1, 1])` (the base model's forward) once in probe mode and replace
    `step.layers`' shapes by what each layer's attention computed. A probe that fails for another reason than a
    refusal leaves the config's shapes (each layer's first real call still checks them)."""
    step.probe, step.stand_in = {}, True
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            run(ids, ids)
        probed = step.probe
    except UnsupportedArchitectureError:
        raise
    except Exception as exc:   # noqa: BLE001 - the config's shapes stay, checked at each layer's first call
        logger.info("transformers backend: the KV shape probe failed (%s: %s); KV cache specs from the config",
                    type(exc).__name__, exc)
        probed = {}
    finally:
        step.probe, step.stand_in = None, False
    for index, seen in sorted(probed.items()):
        step.layers[index] = merged(index, step.layers[index], seen)
    unknown = [i for i, layer in enumerate(step.layers) if layer.config_error is not None and i not in probed]
    if unknown:
        raise UnsupportedArchitectureError(
            f"transformers backend: the KV shapes of layers {unknown} could not be read from the config "
            f"({step.layers[unknown[0]].config_error}) nor seen in a probe forward")


def merged(index: int, layer: LayerAttention, seen: ProbedAttention) -> LayerAttention:
    """The probed shapes under the config's span (which the engine's KV cache groups were planned from); a window
    the module passes that the span does not have is refused."""
    window = layer.span.size if layer.span.kind == SLIDING else None
    if seen.sliding_window is not None and seen.sliding_window != window:
        raise UnsupportedArchitectureError(
            f"transformers backend: {seen.module} (layer {index}) attends through a sliding window of "
            f"{seen.sliding_window}; the config's layer span is {layer.span}")
    if (seen.num_kv_heads, seen.key_dim, seen.value_dim) != (layer.num_kv_heads, layer.key_dim, layer.value_dim) \
            and layer.config_error is None:
        logger.info("transformers backend: layer %d (%s) keeps %d KV heads of %d / %d (the config reads %d of %d / "
                    "%d): the cache takes the module's", index, seen.module, seen.num_kv_heads, seen.key_dim,
                    seen.value_dim, layer.num_kv_heads, layer.key_dim, layer.value_dim)
    return replace(layer, num_kv_heads=seen.num_kv_heads, key_dim=seen.key_dim, value_dim=seen.value_dim,
                   config_error=None)
