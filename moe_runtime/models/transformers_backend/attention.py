"""Our paged attention as a transformers attention implementation (`attn_implementation="moe_runtime"`).

transformers' attention modules project, normalise and rotate q/k themselves and then call the registered
function with query [1, Hq, T, D] and the new key/value [1, Hkv, T, D] (no transformers cache is passed, so
these are the step's new tokens only). The step's ragged batch runs packed as batch 1 of T tokens; this
function stores the new K/V in the layer's paged cache and computes each sequence's causal attention over its
cached context with the engine's kernels (attention_ops.split_attention: one-token rows through the paged decode
kernel, the others through the varlen path), so chunked prefill, prefix caching and windowed KV groups work as
for a native layer.

What transformers passes is honoured or refused by name: `scaling`, `sliding_window` (which must agree with the
span the KV cache spec took from the config), `softcap` (Gemma 2: softcap_attention.py), `s_aux` (gpt-oss's
sinks), GQA (the kernels read Hq // Hkv query heads per KV head). No mask function is registered for the name:
transformers then builds no mask at all (masking_utils skips implementations without one), and a dense mask that
reaches this function anyway is refused, since the causal/window structure here comes from the batch.
"""
from __future__ import annotations

import torch

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_ops import paged_varlen_attention, split_attention, varlen_causal_attention
from moe_runtime.layers.attention_span import SLIDING
from moe_runtime.models.transformers_backend.probe import ProbedAttention
from moe_runtime.models.transformers_backend.softcap_attention import softcapped_attention
from moe_runtime.models.transformers_backend.step_context import STEP_ATTRIBUTE, LayerAttention, StepContext

ATTENTION_IMPLEMENTATION = "moe_runtime"
# keyword arguments transformers' layers pass along that change nothing here (each checked where it could)
PASSED_THROUGH = frozenset({"position_ids", "use_cache", "output_attentions", "cache_position", "return_dict",
                            "output_hidden_states", "dropout", "is_causal", "position_embeddings"})


def register_attention() -> None:
    """Make "moe_runtime" an attention implementation transformers' modules can be built with (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention)


def _refuse(module, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"transformers backend: {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) {what}")


def _check_handed(module, attention_mask, kwargs) -> None:
    if attention_mask is not None:
        raise _refuse(module, f"was handed a dense attention mask {tuple(attention_mask.shape)}: the paged "
                              "attention takes its causal and window structure from the step, not a mask")
    unknown = sorted(k for k, v in kwargs.items() if k not in PASSED_THROUGH and v is not None)
    if unknown:
        raise _refuse(module, f"passes {', '.join(unknown)} to its attention, which the paged attention does "
                              "not implement")
    if kwargs.get("is_causal") is False:
        raise _refuse(module, "asks for bidirectional attention (is_causal=False)")
    if kwargs.get("dropout"):
        raise _refuse(module, f"asks for attention dropout {kwargs['dropout']} (the model is not in eval mode)")


def _check_call(module, layer: LayerAttention, key, value, attention_mask, sliding_window, kwargs) -> None:
    _check_handed(module, attention_mask, kwargs)
    shape = (key.shape[1], key.shape[3], value.shape[3])
    if shape != (layer.num_kv_heads, layer.key_dim, layer.value_dim):
        raise _refuse(module, f"computes {shape[0]} KV heads of key dim {shape[1]} and value dim {shape[2]}; the "
                              f"KV cache spec taken from the config holds {layer.num_kv_heads} heads of "
                              f"{layer.key_dim} / {layer.value_dim}")
    window = layer.span.size if layer.span.kind == SLIDING else None
    if sliding_window is not None and sliding_window != window:
        raise _refuse(module, f"attends through a sliding window of {sliding_window}; the config's layer span "
                              f"is {layer.span}")


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D|Dv] -> ([1, T, Hq, Dv], no weights)."""
    step: StepContext | None = getattr(module, STEP_ATTRIBUTE, None)
    if step is None:
        raise _refuse(module, "has no moe_runtime step context (it was not built by the transformers backend)")
    if query.shape[0] != 1:
        raise _refuse(module, f"ran a batch of {query.shape[0]}: the backend packs a step as one row of tokens")
    if step.probe is not None:   # the KV shape probe (probe.py): record what this layer was handed
        _check_handed(module, attention_mask, kwargs)
        step.probe.setdefault(module.layer_idx, ProbedAttention(type(module).__name__, key.shape[1], key.shape[3],
                                                                value.shape[3], sliding_window))
    if step.stand_in:   # an idle rank's stand-in token: no cache is touched (step_context.StepContext.stand_in)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3]), None
    index = module.layer_idx
    layer = step.layers[index]
    if index not in step.checked:
        _check_call(module, layer, key, value, attention_mask, sliding_window, kwargs)
        step.checked.add(index)
    elif attention_mask is not None:
        raise _refuse(module, "was handed a dense attention mask")
    cache = step.cache_of(index)
    batch = step.batch.for_group(cache.group)   # a windowed layer's own block tables and slots
    q = query[0].transpose(0, 1).contiguous()                                   # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()                                     # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()                                   # [T, Hkv, Dv]
    batch.write_kv(cache, k, v)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    sinks = None if s_aux is None else s_aux.float()                            # [Hq]
    span, kernels = layer.span, step.attention
    num_tokens = q.shape[0]
    if num_tokens == 0:
        out = q.new_zeros(0, q.shape[1], v.shape[-1])
    elif softcap is not None:
        out = softcapped_attention(q, batch, cache, scale, span, float(softcap), sinks)
    else:
        def single(rows, block_tables, context_lens, key_starts=None):   # one new token per sequence: paged
            return kernels.decode(q if rows is None else q[rows], cache.keys, cache.values, block_tables,
                                  context_lens, scale, key_starts=key_starts, sinks=sinks)

        def varlen(seqs):                                                 # prefills and chunks, with context
            if kernels.prefill is not None:
                return paged_varlen_attention(q, batch, kernels.prefill, cache.keys, cache.values, scale, span,
                                              seqs, sinks=sinks)
            return varlen_causal_attention(q, batch, lambda seq: cache.gather(batch.context_slots(seq)), scale,
                                           span, seqs, sinks)

        out = split_attention(batch, span, single, varlen)                      # [T, Hq, Dv]
    return out[None], None                                                      # [1, T, Hq, Dv]
