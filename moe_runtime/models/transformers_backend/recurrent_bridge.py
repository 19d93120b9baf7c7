"""The seam between our recurrent-state slots and transformers' cache object, for a model run through transformers.

Before a forward of some rows (one sequence, or decode rows of one step run as a batch), `load` puts each row's
state, read from its slot (or a snapshot row) of every recurrent layer's `LayerStateCache`, into the transformers
cache's linear-attention layers (or MiniMax's `linear_cache`) in transformers' own shapes and dtypes, marked as
having a previous state, so the mixers continue from it; rows whose first token is in this forward start instead
from transformers' own empty state (its prefill path, as `generate` runs it). After the forward `store` writes the
states transformers left back, packed (recurrent_state.py), into the rows given: the slots, or the snapshot rows a
prefix-cache capture asks for after some of the tokens (the caller then runs the rest of the tokens, from the
states it just stored).

Rows run together must all be fresh or all continuing (transformers keeps one `has_previous_state` per layer), and
the caller runs them in a [B, T] batch with one sequence per row: transformers' mixers know no packed batch.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from moe_runtime.layers.state_cache import LayerStateCache
from moe_runtime.models.transformers_backend.recurrent_state import CONV, LayerState, RecurrentLayout, StatePart


class RecurrentStateBridge:
    def __init__(self, layout: RecurrentLayout, dtype: torch.dtype):
        self.layout = layout
        self.dtype = dtype     # the model's compute dtype: a part's dtype in transformers unless its spec says
        # the dtype transformers itself gave each (layer, kind, index) when it last left one: what it reads back
        self.seen_dtypes: dict[tuple[int, str, int], torch.dtype] = {}

    def load(self, hf_cache: Cache, caches: Mapping[int, LayerStateCache], rows: list[int], fresh: bool,
             num_tokens: int, past_tokens: int = 0, layers: tuple[int, ...] | None = None,
             indices: frozenset[int] | None = None) -> None:
        """Give `hf_cache` the states of `rows` (state rows of `caches`, layer -> its cache) for a forward of
        `num_tokens` tokens per row; `fresh`: the rows start their sequences (transformers' empty states).
        `past_tokens`: what the rows computed before (transformers' linear token count; masks come from ours).
        `layers`: only these recurrent layers (a mixer run on its own), default all; `indices`: only these state
        indices of theirs (one of Inkling's convolutions), default all."""
        if self.layout.linear_cache and len(getattr(hf_cache, "linear_cache", ())) != self.layout.num_layers:
            hf_cache.linear_cache = [None] * self.layout.num_layers
        for state in self._states(layers):
            parts = _parts(state, indices)
            values = None if fresh else self._read(state, parts, caches[state.layer], rows)
            if self.layout.linear_cache:
                hf_cache.linear_cache[state.layer] = None if values is None else values[0]
                continue
            self._load_layer(_linear_layer(hf_cache, state.layer), parts, values, num_tokens, past_tokens)

    def store(self, hf_cache: Cache, caches: Mapping[int, LayerStateCache], rows: list[int],
              layers: tuple[int, ...] | None = None, indices: frozenset[int] | None = None) -> None:
        """Write the states `hf_cache` holds after a forward into `rows` of `caches` (`layers`, `indices`: as in
        `load`; the other parts of the rows stay as they are)."""
        for state in self._states(layers):
            cache = caches[state.layer]
            index = torch.tensor(rows, dtype=torch.long, device=cache.ssm.device)
            flat = cache.ssm.index_select(0, index).view(len(rows), -1)               # [B, N] float32
            for part, start in _parts(state, indices):
                value = self._hf_value(hf_cache, state.layer, part)                  # [B, *shape]
                self.seen_dtypes[(state.layer, part.kind, part.index)] = value.dtype
                flat[:, start:start + part.numel] = value.reshape(len(rows), part.numel).float()
            cache.ssm.index_copy_(0, index, flat.view(len(rows), *cache.ssm.shape[1:]))

    def _states(self, layers: tuple[int, ...] | None) -> list[LayerState]:
        return list(self.layout.layers) if layers is None else [self.layout.of_layer(layer) for layer in layers]

    def _read(self, state: LayerState, parts: list[tuple[StatePart, int]], cache: LayerStateCache,
              rows: list[int]) -> list[torch.Tensor]:
        """Each of `parts` of `rows`' states, [B, *shape] in transformers' dtype for it (fresh tensors:
        transformers updates them in place)."""
        index = torch.tensor(rows, dtype=torch.long, device=cache.ssm.device)
        flat = cache.ssm.index_select(0, index).view(len(rows), -1)                  # [B, N] float32
        return [flat[:, start:start + part.numel].reshape(len(rows), *part.shape).to(self._dtype_of(state, part))
                for part, start in parts]

    def _dtype_of(self, state: LayerState, part: StatePart) -> torch.dtype:
        return self.seen_dtypes.get((state.layer, part.kind, part.index)) or part.dtype or self.dtype

    def _load_layer(self, layer: LinearAttentionCacheLayerMixin, parts: list[tuple[StatePart, int]],
                    values: list[torch.Tensor] | None, num_tokens: int, past_tokens: int) -> None:
        """Reset the layer's linear-attention states (its attention K/V, if it is a hybrid layer, stay), then set
        `values` as its previous states."""
        LinearAttentionCacheLayerMixin.__init__(layer, number_of_states=layer.number_of_states)
        if values is None:
            return
        for (part, _), value in zip(parts, values):
            if part.kind == CONV:
                layer.conv_states[part.index] = value
                layer.conv_kernel_size[part.index] = part.shape[-1]
                layer.is_conv_states_initialized[part.index] = True
            else:
                layer.recurrent_states[part.index] = value
                layer.is_recurrent_states_initialized[part.index] = True
            layer.has_previous_state[part.index] = True
        layer.device, layer.dtype = values[0].device, values[0].dtype
        layer.cumulative_length_linear = torch.tensor(past_tokens, device=values[0].device)
        if self.layout.scan_ignores_state and num_tokens > 1:
            layer.activate_past_recording(recurrent_states_to_keep=num_tokens)

    def _hf_value(self, hf_cache: Cache, layer_idx: int, part: StatePart) -> torch.Tensor:
        if self.layout.linear_cache:
            value = hf_cache.linear_cache[layer_idx]
        else:
            layer = _linear_layer(hf_cache, layer_idx)
            value = (layer.conv_states if part.kind == CONV else layer.recurrent_states)[part.index]
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"layer {layer_idx} left no {part.kind} state {part.index} after the forward")
        if part.kind == CONV:
            value = value[..., value.shape[-1] - part.shape[-1]:]   # past recording keeps the whole chunk's inputs
        if tuple(value.shape[1:]) != part.shape:
            raise RuntimeError(f"layer {layer_idx}'s {part.kind} state {part.index} is {tuple(value.shape[1:])} in "
                               f"transformers, {part.shape} in the recurrent layout of {self.layout.model_type}")
        return value


def _parts(state: LayerState, indices: frozenset[int] | None) -> list[tuple[StatePart, int]]:
    """(part, its start in the packed row) of `state`'s parts at `indices` (all where None)."""
    return [(part, start) for part, start in zip(state.parts, state.offsets())
            if indices is None or part.index in indices]


def _linear_layer(hf_cache: Cache, layer_idx: int) -> LinearAttentionCacheLayerMixin:
    layer = hf_cache.layers[layer_idx]
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        raise RuntimeError(f"transformers' cache layer {layer_idx} is a {type(layer).__name__}, not a "
                           "linear-attention layer")
    return layer
