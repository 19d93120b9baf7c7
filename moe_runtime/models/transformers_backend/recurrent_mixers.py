"""Recurrent mixers (Mamba, Mamba2, short convolutions, linear attention) inside the one batched forward of the
transformers backend, each sequence run on its own and its state kept in our state cache.

The wrapper runs a step as one row of T packed tokens; attention and MoE take it as it is, but transformers'
recurrent mixers read one sequence per row and their state from transformers' cache object. So each recurrent
layer's mixer module (the module of that `layer_idx` the decoder layer calls with a `cache`) gets a forward of
its own (`RecurrentMixer`, set on the instance: the parameters and their names stay transformers'), which splits
the packed rows by the step's sequences (`StepContext.batch`) and calls transformers' forward:
- the decode rows (one new token, a state to continue from) together as a [B, 1] batch;
- every other sequence alone as [1, t], its first chunk from transformers' empty state (its prefill path, as
  `generate` runs it), a later chunk from the state its slot kept;
loading each call's states from the sequence's slot of the layer's `LayerStateCache` (`StepContext.caches[layer]`)
and storing them back (`RecurrentStateBridge`). Where the block manager snapshots a prefix's state (the runner's
`LayerStateCache.captures`: offsets into the sequence's scheduled tokens, also speculation's draft checkpoints),
the sequence's tokens are cut there and the slot's state after each piece is copied into the snapshot row.

Cost: a mixer call per prefilling sequence and one for all decodes, per recurrent layer and step; attention and
the experts stay one batched call.
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

CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")   # what transformers' mixers call their cache


class RecurrentMixer:
    """The forward of one recurrent layer's mixer over a packed step (installed as `module.forward`)."""

    def __init__(self, module: nn.Module, layer: int, bridge: RecurrentStateBridge, step, hf_cache):
        self.original = module.forward            # transformers' own, bound
        self.layer = layer
        self.bridge = bridge
        self.step = step                          # the wrapper's StepContext (batch, caches)
        self.hf_cache = hf_cache                  # transformers' cache object this layer's calls load into
        self.returns_tuple = None                 # whether transformers' forward returns (output, extra)

    def __call__(self, *args, **kwargs):
        hidden, extra = (kwargs.pop("hidden_states"), args) if "hidden_states" in kwargs else (args[0], args[1:])
        if extra or hidden.shape[0] != 1:                                            # hidden [1, T, H]
            raise UnsupportedArchitectureError(
                f"transformers backend: the recurrent mixer of layer {self.layer} was called with {len(extra)} "
                f"more positional arguments / a batch of {hidden.shape[0]}; it takes the packed step")
        for name in CACHE_ARGUMENTS:
            kwargs.pop(name, None)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None       # one sequence per row, no padding
        if hidden.shape[1] == 0:   # a rank with no tokens this step (DP attention): transformers' own empty pass
            return self.original(hidden, **kwargs)
        batch: AttentionBatch = self.step.batch
        cache: LayerStateCache = self.step.caches[self.layer]
        out = hidden.new_empty(hidden.shape)
        if batch.state_slots is None:
            raise RuntimeError(f"layer {self.layer} keeps a recurrent state, but the step came without state slots")
        decodes = [b for b in range(batch.num_seqs)
                   if batch.query_lens[b] == 1 and batch.context_lens[b] > 1]
        if decodes:
            rows = torch.tensor([batch.query_start[b] for b in decodes], device=hidden.device)
            slots = [batch.state_slots[b] for b in decodes]
            result = self._call(hidden[0, rows][:, None], _rows(kwargs, hidden.shape[1], rows), cache, slots,
                                fresh=False, past=min(batch.context_lens[b] - 1 for b in decodes))
            out[0, rows] = result[:, 0]
            for slot in slots:
                _capture(cache, slot, 1)
        for b in range(batch.num_seqs):
            if b in decodes:
                continue
            start, length = batch.query_start[b], batch.query_lens[b]
            past, slot = batch.context_lens[b] - length, batch.state_slots[b]
            _capture(cache, slot, 0)
            cuts = sorted({offset for offset, _ in cache.captures.get(slot, ()) if 0 < offset < length} | {length})
            first = 0
            for cut in cuts:
                piece = slice(start + first, start + cut)
                out[0, piece] = self._call(hidden[:, piece], _piece(kwargs, hidden.shape[1], piece), cache, [slot],
                                           fresh=past + first == 0, past=past + first)[0]
                _capture(cache, slot, cut)
                first = cut
        return (out, None) if self.returns_tuple else out

    def _call(self, hidden: torch.Tensor, kwargs: dict, cache: LayerStateCache, slots: list[int], fresh: bool,
              past: int) -> torch.Tensor:  # [B, t, H] -> [B, t, H]
        caches = {self.layer: cache}
        self.bridge.load(self.hf_cache, caches, slots, fresh, hidden.shape[1], past, layers=(self.layer,))
        result = self.original(hidden, cache=self.hf_cache, **kwargs)
        self.bridge.store(self.hf_cache, caches, slots, layers=(self.layer,))
        self.returns_tuple = isinstance(result, tuple)
        return result[0] if self.returns_tuple else result


def install_recurrent_mixers(hf_model: nn.Module, layout: RecurrentLayout, step, dtype: torch.dtype) -> int:
    """Give every recurrent layer's mixer in `hf_model` a `RecurrentMixer` forward; returns how many."""
    bridge = RecurrentStateBridge(layout, dtype)
    hf_cache = _new_cache(hf_model, layout)
    mixers = find_mixers(hf_model, layout)
    for layer, module in mixers.items():
        object.__setattr__(module, "forward", RecurrentMixer(module, layer, bridge, step, hf_cache))
    return len(mixers)


def find_mixers(hf_model: nn.Module, layout: RecurrentLayout) -> dict[int, nn.Module]:
    """Layer -> the outermost module below its decoder layer with that `layer_idx` whose forward takes a cache."""
    base = getattr(hf_model, hf_model.base_model_prefix)
    decoder_layers = {id(module) for module in getattr(base, "layers", ())}
    found: dict[int, tuple[str, nn.Module]] = {}
    wanted = set(layout.layer_indices)
    for name, module in hf_model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if layer not in wanted or id(module) in decoder_layers or not _takes_cache(module):
            continue
        if layer not in found or name.count(".") < found[layer][0].count("."):
            found[layer] = (name, module)
    missing = sorted(wanted - set(found))
    if missing:
        raise UnsupportedArchitectureError(
            f"transformers backend ({layout.model_type}): no module of layers {missing} takes a cache "
            "(the recurrent mixer whose state the backend keeps)")
    return {layer: module for layer, (_, module) in sorted(found.items())}


def _takes_cache(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in CACHE_ARGUMENTS)


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
