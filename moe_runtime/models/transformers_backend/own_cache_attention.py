"""Attention layers transformers computes with its own cache and mask, run sequence by sequence.

Most attention modules hand the attention function query/key/value and nothing else the step's packed row would
get wrong: those run batched through our paged kernels (attention.py). Some build more from transformers' cache
and mask first: a DeepSeek-Sparse-Attention-style indexer (layer type "indexed_attention": its own per-token key
cache, a top-k over the causal mask turned into an index mask), a relative position bias over the cache's key
positions (Inkling), a dynamic mask from the cached values (Doge). For those layers (`own_cache_layers`) the attention module gets a forward of its own
(`OwnCacheAttention`, set on the instance; the parameters stay transformers') that calls transformers' forward once
per sequence of the step, on that sequence's rows, with
- a real causal mask for the sequence ([1, 1, t, width] additive, the query positions against its whole context,
  a window honoured), as transformers' eager attention takes it;
- a `PagedSequenceCache` (paged_hf_cache.py) for the layer: the new tokens' entries (and indexer keys) written into
  our paged cache, the sequence's whole context read back from its blocks;
- the module's config copied with attn_implementation "eager" (transformers' own attention on that mask; the
  modules test the name to apply their index mask);
- `StepContext.batch` narrowed to that sequence meanwhile, for recurrent mixers inside the module (Inkling's short
  convolutions, recurrent_mixers.py), which split the rows they are given by it.
The paged entry of such a layer is one flat row per token, sized by what the shape probe saw the module hand its
cache (probe.py runs the modules once; `OwnCacheAttention` records then, reported as one head of that width).

Cost: one transformers attention call per sequence and layer, decodes included, each gathering its whole context
and computing a dense [t, context] score matrix (no paged kernel): fine for tiny and test models, slow for long
contexts and large batches. Other layers of the model keep the batched path.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_span import SLIDING
from moe_runtime.models.micro_batches import sequence_run
from moe_runtime.models.transformers_backend.paged_hf_cache import EntryLayout, PagedSequenceCache, RecordingCache
from moe_runtime.models.transformers_backend.probe import ProbedAttention
from moe_runtime.models.transformers_backend.forward_signature import takes_any_argument

OWN_CACHE_LAYER_TYPES = frozenset({"indexed_attention"})
# model types whose every attention layer needs transformers' cache: what their attention computes from it
OWN_CACHE_MODEL_TYPES = {"inkling_text": "a relative position bias over the cache's key positions",
                         "doge": "a dynamic mask from the cached values over the causal mask"}
# model types with such layers that still cannot run this way, and why
REFUSED_MODEL_TYPES = {
    "kolibri1_1": "its indexed layers share keys and an index pool across layers (shared_kv_states, index_pool), "
                  "which transformers' decoder passes along the whole row",
    "qwen4_exp_text": "its QSA layers take rotary embeddings for the whole context's positions from the decoder, "
                      "which computes them for the new tokens of a packed row only",
}
CACHE_ARGUMENTS = ("cache", "past_key_values")


def own_cache_layers(hf_config) -> list[int]:
    """The layers whose attention runs here (by layer type, or every attention layer of some model types)."""
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in OWN_CACHE_MODEL_TYPES:
        return list(range(hf_config.num_hidden_layers))
    return [i for i, kind in enumerate(layer_types) if kind in OWN_CACHE_LAYER_TYPES]


def check_own_cache(architecture: str, hf_config) -> None:
    """Refuse by name a model whose own-cache layers cannot run sequence by sequence."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES and own_cache_layers(hf_config):
        raise UnsupportedArchitectureError(
            f"transformers backend: {architecture} ({model_type}) has layers of type 'indexed_attention' (first: "
            f"layer {own_cache_layers(hf_config)[0]}) the backend cannot run: {REFUSED_MODEL_TYPES[model_type]}")


class OwnCacheAttention:
    """The forward of one own-cache attention module over a packed step (installed as `module.forward`)."""

    def __init__(self, module: nn.Module, layer: int, step):
        self.original = module.forward            # transformers' own, bound
        self.signature = inspect.signature(self.original)
        self.cache_name = next(name for name in CACHE_ARGUMENTS if name in self.signature.parameters)
        self.name = type(module).__name__
        self.layer = layer
        self.step = step
        self.layout = EntryLayout()               # what the module hands its cache (the shape probe fills it)
        window = getattr(module, "sliding_window", None)   # the module's own (Inkling's is not in layer_span's terms)
        self.mask_window = window if isinstance(window, int) and window > 0 else None

    def _window(self) -> int | None:
        span = self.step.layers[self.layer].span
        return span.size if span.kind == SLIDING else None

    def __call__(self, *args, **kwargs):
        arguments = dict(self.signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop("kwargs", {}))
        first = next(iter(self.signature.parameters))
        hidden = arguments.pop(first)                                            # [1, T, H]
        for name in CACHE_ARGUMENTS + ("attention_mask",):
            arguments.pop(name, None)
        step = self.step
        if step.stand_in:   # the shape probe, or an idle rank's stand-in token: no paged cache touched
            recording = RecordingCache(self.layout if step.probe is not None else EntryLayout())
            out = self.original(hidden, attention_mask=self._mask(hidden, 0, hidden.shape[1], hidden.shape[1]),
                                **{self.cache_name: recording}, **arguments)
            if step.probe is not None:
                step.probe[self.layer] = ProbedAttention(self.name, 1, self.layout.key_width,
                                                         self.layout.entry_value_width, self._window())
            return out
        if hidden.shape[0] != 1:
            raise UnsupportedArchitectureError(
                f"transformers backend: {self.name} (layer {self.layer}) was called on a batch of {hidden.shape[0]} "
                "rows; it takes the packed step as one")
        if self.layout.key is None:
            raise UnsupportedArchitectureError(
                f"transformers backend: {self.name} (layer {self.layer}) was not seen by the shape probe, so its "
                "paged entry has no known size")
        num_tokens = hidden.shape[1]
        cache = step.cache_of(self.layer)
        whole = step.batch
        batch = whole.for_group(cache.group)
        pieces: list[tuple[slice, tuple]] = []
        try:
            for b in range(batch.num_seqs):
                start, length = batch.query_start[b], batch.query_lens[b]
                if length == 0:
                    continue
                context = batch.context_lens[b]
                width = context if batch.prompt_lens is None else max(context, batch.prompt_lens[b])
                rows = slice(start, start + length)
                step.batch = sequence_run(whole, b, b + 1)   # for recurrent mixers inside the module
                result = self.original(hidden[:, rows], attention_mask=self._mask(hidden, context - length, length,
                                                                                  width),
                                       **{self.cache_name: PagedSequenceCache(self.layer, cache, batch, b,
                                                                              self.layout, width)},
                                       **_sliced(arguments, num_tokens, rows))
                pieces.append((rows, result if isinstance(result, tuple) else (result,)))
        finally:
            step.batch = whole
        if not pieces:
            raise RuntimeError(f"layer {self.layer}: a step with no tokens reached its attention")
        packed = [_packed(num_tokens, [(rows, values[i]) for rows, values in pieces]) if i != 1 else None
                  for i in range(len(pieces[0][1]))]   # [1]: attention weights, none kept
        return packed[0] if len(packed) == 1 else tuple(packed)

    def _mask(self, hidden: torch.Tensor, past: int, length: int, width: int) -> torch.Tensor:
        """[1, 1, length, width] additive causal mask: query i (position past + i) sees keys 0..past + i, the last
        `window` of them on a sliding layer."""
        positions = torch.arange(past, past + length, device=hidden.device)[:, None]   # [t, 1]
        keys = torch.arange(width, device=hidden.device)[None, :]                     # [1, W]
        allowed = keys <= positions
        window = self.mask_window or self._window()
        if window is not None:
            allowed &= keys > positions - window
        mask = torch.zeros(length, width, dtype=hidden.dtype, device=hidden.device)
        return mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]


def install_own_cache_attention(hf_model: nn.Module, layers: list[int], step) -> int:
    """Give each listed layer's attention module an `OwnCacheAttention` forward and an eager config; returns how
    many."""
    base = getattr(hf_model, hf_model.base_model_prefix)
    decoder_layers = list(getattr(base, "layers", ()))
    eager = copy.copy(hf_model.config)
    eager._attn_implementation_internal = "eager"   # this copy only: the other layers stay on the paged path
    count = 0
    for layer in layers:
        module = _attention_module(decoder_layers[layer], layer) if layer < len(decoder_layers) else None
        if module is None:
            raise UnsupportedArchitectureError(
                f"transformers backend: layer {layer} has no attention module taking a cache to run with its own "
                "cache and mask")
        object.__setattr__(module, "config", eager)
        object.__setattr__(module, "forward", OwnCacheAttention(module, layer, step))
        count += 1
    return count


def _attention_module(decoder_layer: nn.Module, layer: int) -> nn.Module | None:
    """The outermost module below the decoder layer with this `layer_idx`, an attention class, taking a cache."""
    for name, module in decoder_layer.named_modules():
        if name and getattr(module, "layer_idx", None) == layer and "Attention" in type(module).__name__ \
                and takes_any_argument(module, CACHE_ARGUMENTS):
            return module
    return None


def _packed(num_tokens: int, pieces: list[tuple[slice, object]]):
    """One output of the per-sequence calls as the packed row gives it: per-token tensors [1, t, ...] written at their
    rows of a [1, T, ...] tensor, a last axis of different widths (HY-V4's top-k token indices, handed on to the next
    layer: a sequence with less context picks fewer) padded by repeating each row's last entry, which names a key
    already chosen; anything else as the last call returned it."""
    values = [value for _, value in pieces]
    first = values[0]
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == rows.stop - rows.start
               for (rows, _), v in zip(pieces, values)):
        return values[-1]
    width = max(v.shape[-1] for v in values)
    out = first.new_empty(1, num_tokens, *first.shape[2:-1], width)                # [1, T, ..., width]
    for rows, value in pieces:
        if value.shape[-1] < width:
            value = torch.cat([value, value[..., -1:].expand(*value.shape[:-1], width - value.shape[-1])], dim=-1)
        out[:, rows] = value
    return out


def _sliced(arguments: dict, num_tokens: int, rows: slice) -> dict:
    """The module's other arguments for some rows of the packed row: per-token tensors ([1, T, ...]) cut to them."""
    return {name: _cut(value, num_tokens, rows) for name, value in arguments.items()}


def _cut(value, num_tokens: int, rows: slice):
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_tokens:
        return value[:, rows]
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(item, num_tokens, rows) for item in value)
    return value
