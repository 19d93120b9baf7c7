"""Recurrent mixers (Mamba, Mamba2, short convolutions, linear attention) inside the one batched forward of the
transformers backend, each sequence run on its own and its state kept in our state cache.

The wrapper runs a step as one row of T packed tokens; attention and MoE take it as it is, but transformers'
recurrent mixers read one sequence per row and their state from transformers' cache object. So every module that
keeps a layer's state (`find_mixers`: the mixer of a recurrent layer; in an attention layer with a state beside,
the part keeping it, ZAYA's q/k convolution or Inkling's short convolutions, so the attention stays batched) gets
a forward of its own (`RecurrentMixer`, set on the instance: the parameters and their names stay transformers'),
which splits the packed rows by the step's sequences (`StepContext.batch`) and calls transformers' forward:
- the decode rows (one new token, a state to continue from) together as a [B, 1] batch;
- every other sequence alone as [1, t], its first chunk from transformers' empty state (its prefill path, as
  `generate` runs it), a later chunk from the state its slot kept;
loading each call's states from the sequence's slot of the layer's `LayerStateCache` (in `StepContext.caches` at
`RecurrentLayout.cache_index`) and storing them back (`RecurrentStateBridge`). Where the block manager snapshots a
prefix's state (the runner's `LayerStateCache.captures`: offsets into the sequence's scheduled tokens, also
speculation's draft checkpoints), the sequence's tokens are cut there and the slot's state after each piece is
copied into the snapshot row. An idle rank's stand-in token runs with no cache and touches no state.

Cost: per state-keeping module and step, one call per prefilling sequence (one more per snapshot cut) and one for
all decodes; attention and the experts stay one batched call.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.state_cache import LayerStateCache
from moe_runtime.models.transformers_backend.recurrent_bridge import RecurrentStateBridge
from moe_runtime.models.transformers_backend.recurrent_state import RecurrentLayout
from moe_runtime.models.transformers_backend.forward_signature import takes_any_argument

CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")   # what transformers' mixers call their cache


class RecurrentMixer:
    """The forward of one recurrent module over a packed step (installed as `module.forward`)."""

    def __init__(self, module: nn.Module, layer: int, cache_index: int, bridge: RecurrentStateBridge, step,
                 hf_cache):
        self.original = module.forward            # transformers' own, bound
        self.signature = inspect.signature(self.original)
        self.layer = layer
        self.cache_index = cache_index            # where the layer's LayerStateCache is in the step's caches
        self.bridge = bridge
        self.step = step                          # the wrapper's StepContext (batch, caches)
        self.hf_cache = hf_cache                  # transformers' cache object this layer's calls load into
        # the state indices this module reads and writes (one of Inkling's convolutions), None: the layer's all
        index = getattr(module, "conv_idx", None)
        self.indices = frozenset({index}) if isinstance(index, int) else None
        self.state_shapes = {part.shape for part in bridge.layout.of_layer(layer).parts}

    def __call__(self, *args, **kwargs):
        arguments = dict(self.signature.bind(*args, **kwargs).arguments)
        extra = arguments.pop("kwargs", {})
        first = next(iter(self.signature.parameters))
        hidden = arguments.pop(first)                                                # [1, T, H]
        arguments.update(extra)
        for name in CACHE_ARGUMENTS:
            arguments.pop(name, None)
        for name in ("attention_mask", "conv_mask"):
            if name in arguments:
                arguments[name] = None            # one sequence per row, no padding
        if getattr(self.step, "stand_in", False) or hidden.shape[1] == 0:
            # an idle rank's stand-in token (DP attention), or the wrapper's shape probe: transformers' own pass
            # with no cache, no state touched
            return self.original(hidden, **arguments)
        if hidden.shape[0] != 1:
            raise UnsupportedArchitectureError(
                f"transformers backend: the recurrent mixer of layer {self.layer} was called on a batch of "
                f"{hidden.shape[0]} rows; it takes the packed step as one")
        batch: AttentionBatch = self.step.batch
        if batch.state_slots is None:
            raise RuntimeError(f"layer {self.layer} keeps a recurrent state, but the step came without state slots")
        cache: LayerStateCache = self.step.caches[self.cache_index]
        outputs = PackedOutputs(hidden.shape[1], self.state_shapes)
        decodes = [b for b in range(batch.num_seqs) if batch.query_lens[b] == 1 and batch.context_lens[b] > 1]
        if decodes:
            rows = torch.tensor([batch.query_start[b] for b in decodes], device=hidden.device)
            slots = [batch.state_slots[b] for b in decodes]
            outputs.put_rows(rows, self._call(hidden[0, rows][:, None], _rows(arguments, hidden.shape[1], rows),
                                              cache, slots, fresh=False,
                                              past=min(batch.context_lens[b] - 1 for b in decodes)))
            for slot in slots:
                _capture(cache, slot, 1)
        for b in range(batch.num_seqs):
            if b in decodes:
                continue
            start, length = batch.query_start[b], batch.query_lens[b]
            past, slot = batch.context_lens[b] - length, batch.state_slots[b]
            _capture(cache, slot, 0)
            cuts = sorted({offset for offset, _ in cache.captures.get(slot, ()) if 0 < offset < length} | {length})
            first_token = 0
            for cut in cuts:
                piece = slice(start + first_token, start + cut)
                outputs.put_piece(piece, self._call(hidden[:, piece], _piece(arguments, hidden.shape[1], piece), cache,
                                                    [slot], fresh=past + first_token == 0, past=past + first_token))
                _capture(cache, slot, cut)
                first_token = cut
        return outputs.result()

    def _call(self, hidden: torch.Tensor, arguments: dict, cache: LayerStateCache, slots: list[int], fresh: bool,
              past: int):  # [B, t, H] -> transformers' output for it
        caches = {self.layer: cache}
        self.bridge.load(self.hf_cache, caches, slots, fresh, hidden.shape[1], past, layers=(self.layer,),
                         indices=self.indices)
        result = self.original(hidden, cache=self.hf_cache, **arguments)
        self.bridge.store(self.hf_cache, caches, slots, layers=(self.layer,), indices=self.indices)
        return result


class PackedOutputs:
    """What a mixer returns for the packed step, assembled from its calls on pieces and row groups: each per-token
    tensor ([B, t, ...]: the output, or ZAYA's query, key and value) written at its tokens' rows of a [1, T, ...]
    tensor; anything else (MiniMax's state [B, heads, D, D] beside its output) as the last call returned it."""

    def __init__(self, num_tokens: int, state_shapes: set[tuple[int, ...]]):
        self.num_tokens = num_tokens
        self.state_shapes = state_shapes          # a tensor of one of these shapes per row is a state, not tokens
        self.packed: list = []
        self.is_tuple = False

    def put_piece(self, piece: slice, result) -> None:
        self._put(result, lambda packed, value: packed[0].__setitem__(piece, value[0]))

    def put_rows(self, rows: torch.Tensor, result) -> None:
        self._put(result, lambda packed, value: packed[0].__setitem__(rows, value[:, 0]))

    def _put(self, result, write) -> None:
        self.is_tuple = isinstance(result, tuple)
        values = list(result) if self.is_tuple else [result]
        rows_and_tokens = tuple(values[0].shape[:2])
        per_token = [isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == rows_and_tokens
                     and tuple(value.shape[1:]) not in self.state_shapes for value in values]
        if not self.packed:
            self.packed = [value.new_empty(1, self.num_tokens, *value.shape[2:]) if token else value
                           for value, token in zip(values, per_token)]
        for i, (value, token) in enumerate(zip(values, per_token)):
            if token:
                write(self.packed[i], value)
            else:
                self.packed[i] = value

    def result(self):
        return tuple(self.packed) if self.is_tuple else self.packed[0]


def install_recurrent_mixers(hf_model: nn.Module, layout: RecurrentLayout, step, dtype: torch.dtype) -> int:
    """Give every module keeping a recurrent layer's state in `hf_model` a `RecurrentMixer` forward; returns how
    many."""
    bridge = RecurrentStateBridge(layout, dtype)
    hf_cache = _new_cache(hf_model, layout)
    mixers = find_mixers(hf_model, layout)
    for layer, modules in mixers.items():
        for module in modules:
            object.__setattr__(module, "forward", RecurrentMixer(module, layer, layout.cache_index(layer), bridge, step,
                                                                 hf_cache))
    return sum(len(modules) for modules in mixers.values())


def find_mixers(hf_model: nn.Module, layout: RecurrentLayout) -> dict[int, list[nn.Module]]:
    """Layer -> the modules below its decoder layer with that `layer_idx` whose forward takes a cache and that hold
    no such module themselves: the mixer of a recurrent layer; in an attention layer keeping a state, the part that
    keeps it (ZAYA's q/k convolution, Inkling's four short convolutions), so the attention itself stays batched."""
    base = getattr(hf_model, hf_model.base_model_prefix)
    decoder_layers = {id(module) for module in getattr(base, "layers", ())}
    wanted = set(layout.layer_indices)
    candidates = [(name, module) for name, module in hf_model.named_modules()
                  if getattr(module, "layer_idx", None) in wanted and id(module) not in decoder_layers
                  and takes_any_argument(module, CACHE_ARGUMENTS)]
    names = [name for name, _ in candidates]
    found: dict[int, list[nn.Module]] = {}
    for name, module in candidates:
        if not any(other.startswith(name + ".") for other in names):
            found.setdefault(module.layer_idx, []).append(module)
    missing = sorted(wanted - set(found))
    if missing:
        raise UnsupportedArchitectureError(
            f"transformers backend ({layout.model_type}): no module of layers {missing} takes a cache "
            "(the recurrent mixer whose state the backend keeps)")
    return dict(sorted(found.items()))


def _new_cache(hf_model: nn.Module, layout: RecurrentLayout):
    """transformers' cache object the mixers load into (MiniMax insists on its own class)."""
    if layout.linear_cache:
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    from transformers import DynamicCache

    return DynamicCache(config=hf_model.config)


def _capture(cache: LayerStateCache, slot: int, offset: int) -> None:
    """Copy the slot's state into the snapshot rows asking for it after `offset` of the step's tokens."""
    for at, row in cache.captures.get(slot, ()):
        if at == offset:
            cache.ssm[row] = cache.ssm[slot]


def _piece(kwargs: dict, num_tokens: int, piece: slice) -> dict:
    """The mixer's other arguments for a piece of the packed row: per-token tensors ([1, T, ...]) cut to it."""
    return {name: _map(value, num_tokens, lambda x: x[:, piece]) for name, value in kwargs.items()}


def _rows(kwargs: dict, num_tokens: int, rows: torch.Tensor) -> dict:
    """... for decode rows run as a [B, 1] batch: per-token tensors gathered to [B, 1, ...]."""
    return {name: _map(value, num_tokens, lambda x: x[0, rows][:, None]) for name, value in kwargs.items()}


def _map(value, num_tokens: int, take):
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_tokens:
        return take(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(item, num_tokens, take) for item in value)
    return value
