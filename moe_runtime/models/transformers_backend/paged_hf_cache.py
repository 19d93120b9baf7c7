"""A transformers cache object for one sequence and one layer, backed by that layer's paged KV cache.

Layers whose attention transformers computes with its own cache and mask (own_cache_attention.py) run per
sequence with this object as their `cache`: `update(k, v)` writes the new tokens' entries at their slots of our
paged cache (so prefix caching, chunked prefill, preemption and prefill/decode transfer see them like any other
layer's) and returns the sequence's whole context gathered from its blocks; `update_indexer(k)` does the same for
a sparse-attention indexer's per-token keys. transformers' modules hand these tensors in whatever shapes they keep
(MLA's compressed latent and rope key, expanded heads, a single-head indexer key), so one layer's paged entry is
one flat row per token (`EntryLayout`): the key flattened in the keys tensor, the value then the indexer key
flattened side by side in the values tensor.

The returned context is `width` tokens wide: a prompt chunk's is the whole prompt, as transformers' one-pass
prefill sees it (the tokens after the context are zeros, masked by the caller's mask), since a sparse indexer's
top-k breaks tied scores by the row it is given (see AttentionBatch.index_row_widths).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import LayerKVCache


@dataclass
class EntryLayout:
    """What one layer's transformers cache calls hand per token (shapes without batch and token axes)."""

    key: tuple[int, ...] | None = None       # update's key, per token (e.g. [heads, dim])
    value: tuple[int, ...] | None = None     # update's value, per token
    indexer: tuple[int, ...] | None = None   # update_indexer's key, per token

    @property
    def key_width(self) -> int:
        return math.prod(self.key) if self.key else 1

    @property
    def value_width(self) -> int:
        return math.prod(self.value) if self.value else 0

    @property
    def entry_value_width(self) -> int:
        """The paged value row: the value, then the indexer key."""
        return max(1, self.value_width + (math.prod(self.indexer) if self.indexer else 0))


def _per_token(tensor: torch.Tensor, token_axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[1, ..., t (at token_axis), ...] -> ([t, N] flat rows, the per-token shape)."""
    moved = tensor[0].movedim(token_axis - 1, 0)                           # [t, ...]
    return moved.reshape(moved.shape[0], -1), tuple(moved.shape[1:])


def _unflatten(rows: torch.Tensor, shape: tuple[int, ...], token_axis: int) -> torch.Tensor:
    """[W, N] -> [1, ..., W (at token_axis), ...] (inverse of _per_token)."""
    return rows.view(rows.shape[0], *shape).movedim(0, token_axis - 1)[None]


class RecordingCache:
    """The shape probe's and an idle rank's stand-in cache: records what the layer hands, returns it as is."""

    def __init__(self, layout: EntryLayout):
        self.layout = layout

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.layout.key = _per_token(key_states, 2)[1]
        self.layout.value = _per_token(value_states, 2)[1]
        return key_states, value_states

    def update_indexer(self, key_states, layer_idx=None, *args, **kwargs):
        self.layout.indexer = _per_token(key_states, 1)[1]
        return key_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class PagedSequenceCache:
    """One sequence's view of one layer's paged cache, as transformers' modules call a cache."""

    def __init__(self, layer: int, cache: LayerKVCache, batch: AttentionBatch, seq: int, layout: EntryLayout,
                 width: int):
        self.layer, self.cache, self.batch, self.seq, self.layout = layer, cache, batch, seq, layout
        self.width = width                                                   # tokens of context handed back
        start = batch.query_start[seq]
        self.new_slots = batch.slot_mapping[start:start + batch.query_lens[seq]]   # [t]
        self.context_slots = batch.context_slots(seq)                        # [context]
        self.past = batch.context_lens[seq] - batch.query_lens[seq]

    def _check(self, what: str, got: tuple[int, ...], declared: tuple[int, ...] | None) -> None:
        if got != declared:
            raise UnsupportedArchitectureError(
                f"transformers backend: layer {self.layer} hands its cache's {what} of per-token shape {got}; the "
                f"shape probe saw {declared} (the paged entry was sized from it)")

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:   # [context, N] -> [width, N]
        if rows.shape[0] >= self.width:
            return rows
        return torch.cat([rows, rows.new_zeros(self.width - rows.shape[0], rows.shape[1])])

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        """key/value [1, heads, t, dim] (or any [1, ..., t, dim]) -> the context's, [1, ..., width, dim]."""
        keys, key_shape = _per_token(key_states, 2)                          # [t, K]
        values, value_shape = _per_token(value_states, 2)                    # [t, V]
        self._check("key", key_shape, self.layout.key)
        self._check("value", value_shape, self.layout.value)
        flat_keys = self.cache.keys.view(-1, self.cache.keys.shape[-1])      # [slots, K] (one "head")
        flat_values = self.cache.values.view(-1, self.cache.values.shape[-1])   # [slots, V + I]
        flat_keys.index_copy_(0, self.new_slots, keys.to(flat_keys.dtype))
        width = self.layout.value_width
        flat_values[self.new_slots, :width] = values.to(flat_values.dtype)
        all_keys = self._padded(flat_keys.index_select(0, self.context_slots).to(key_states.dtype))
        all_values = self._padded(flat_values.index_select(0, self.context_slots)[:, :width].to(value_states.dtype))
        return _unflatten(all_keys, key_shape, 2), _unflatten(all_values, value_shape, 2)

    def update_indexer(self, key_states, layer_idx=None, *args, **kwargs):
        """indexer keys [1, t, ...] -> the context's, [1, width, ...]."""
        keys, shape = _per_token(key_states, 1)                              # [t, I]
        self._check("indexer key", shape, self.layout.indexer)
        flat_values = self.cache.values.view(-1, self.cache.values.shape[-1])
        start = self.layout.value_width
        flat_values[self.new_slots, start:start + keys.shape[1]] = keys.to(flat_values.dtype)
        context = flat_values.index_select(0, self.context_slots)[:, start:start + keys.shape[1]]
        return _unflatten(self._padded(context.to(key_states.dtype)), shape, 1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(key length, offset of the first key) the keys `update` returns span."""
        return self.width, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past
