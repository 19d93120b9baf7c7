"""What one rank holds of a DP worker's paged KV cache, as a plain struct that travels in handles.

A prefill rank's `KVShard` names its KV block server and the slice of the cache it holds: decoder
layers [first_layer, first_layer + num_layers) (its pipeline stage) and KV heads [head_start,
head_start + num_heads) of `total_heads` (its attention-TP share; MLA's latent is one head that
every rank holds whole). A decode rank describes its own slice the same way and plans its pulls
from the prefill ranks' shards (`plan.plan_pulls`).

A hybrid model (Qwen3-Next, Qwen3.5-MoE) also keeps, in its linear-attention layers (`state_layers`, global
indices; its KV layers are the others of the range), a fixed-size recurrent state per sequence: a short
convolution's last inputs (`conv_channels` x `conv_width`, in the cache dtype) and a delta-rule state
(`state_heads` x `state_key_dim` x `state_value_dim`, float32), this rank's heads of them under attention TP.
A decode rank pulls those of the request's slot beside its blocks (`state_plan.plan_state_pulls`).

GLM-5's shared sparse-attention layers keep keys (latents) only where its other layers keep index keys too
(`keys_only_layers`): a block of such a layer travels as one tensor.

DeepSeek-V4's layers differ from each other (moe_runtime/layers/compressed_cache.py), so its shard lists each
layer's frames (`compressed_layers`, in layer order): a block holds `rows` compressed entries of each of `dims`
(none on a sliding-only layer), and a sequence's state is the tensors `state` (window keys, carried projections),
all in the cache dtype. Every layer is a state layer; those with entries are KV layers too.

A rank whose engine drafts with a model (the MTP layer, an EAGLE-3 head: `disaggregation/draft_layer.py`) may hold
the drafter's KV layer as one more, after the model's last (`drafter` names the speculative method).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import msgspec
import torch

from moe_runtime.layers.compressed_cache import CompressedAttentionSpec
from moe_runtime.layers.kv_cache import KVCacheSpec
from moe_runtime.layers.state_cache import StateSpec

# the cache dtypes a shard may name (a handle is untrusted input: no other name reaches torch)
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Count = Annotated[int, msgspec.Meta(ge=0, le=2**20)]
Endpoint = Annotated[str, msgspec.Meta(max_length=256)]
MAX_STATE_LAYERS = 4096


class LayerFrames(msgspec.Struct, frozen=True):
    """One DeepSeek-V4 layer's frames: per block `rows` entries of each of `dims` channels, per sequence `state`."""

    rows: Count
    dims: Annotated[tuple[Count, ...], msgspec.Meta(max_length=4)]
    state: Annotated[tuple[tuple[Count, ...], ...], msgspec.Meta(max_length=4)]


class KVLayoutError(ValueError):
    """Two instances' caches cannot exchange blocks (different models, block sizes, or a hole in the layers)."""


class KVShard(msgspec.Struct, frozen=True, kw_only=True):
    endpoint: Endpoint        # the rank's KV block server (tcp://host:port); "" on a decode rank
    first_layer: Count        # global index of its first decoder layer
    num_layers: Count
    head_start: Count         # first KV head it holds, in the model's numbering
    num_heads: Count
    total_heads: Count        # KV heads of the model (1 for MLA's latent)
    key_dim: Count
    value_dim: Count          # 0: keys only (MLA's latent)
    block_size: Count
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    # linear-attention layers (hybrid models; none elsewhere) and the per-sequence state each keeps on this rank
    state_layers: Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_STATE_LAYERS)] = ()
    conv_channels: Count = 0
    conv_width: Count = 0
    state_heads: Count = 0
    state_key_dim: Count = 0
    state_value_dim: Count = 0
    # KV layers whose cache keeps keys only although `value_dim` > 0 (global indices): GLM-5's shared DeepSeek Sparse
    # Attention layers, which keep no index keys beside their latents
    keys_only_layers: Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_STATE_LAYERS)] = ()
    # DeepSeek-V4: each of its layers' frames (empty for every other model)
    compressed_layers: Annotated[tuple[LayerFrames, ...], msgspec.Meta(max_length=MAX_STATE_LAYERS)] = ()
    # the speculative method ("mtp", "eagle3") whose drafter's KV layer is the last of `layers` ("": none here)
    drafter: Annotated[str, msgspec.Meta(max_length=16)] = ""

    @classmethod
    def of(cls, specs: list, first_layer: int, block_size: int, dtype: torch.dtype,
           endpoint: str = "", drafter: str = "") -> "KVShard":
        """The shard of a rank whose owned layers have `specs` (`KVCacheSpec`s, every one alike as in every model
        here, and a hybrid model's `StateSpec`s, likewise alike; or DeepSeek-V4's `CompressedAttentionSpec`s).
        `drafter`: the last spec is that speculative method's drafter layer's."""
        if specs and all(isinstance(spec, CompressedAttentionSpec) for spec in specs):
            return cls._compressed(specs, first_layer, block_size, dtype, endpoint)
        kv = [spec for spec in specs if isinstance(spec, KVCacheSpec)]
        states = [(first_layer + i, spec) for i, spec in enumerate(specs) if isinstance(spec, StateSpec)]
        if not kv and not states:
            raise KVLayoutError("this rank holds no attention layer")
        widest = max(kv, key=lambda spec: spec.value_dim or 0) if kv else None   # keys and values, if any has
        alike = (widest, dataclasses.replace(widest, value_dim=None)) if kv else ()
        if any(spec not in alike for spec in kv) or any(spec != states[0][1] for _, spec in states):
            raise KVLayoutError("KV transfer needs every layer's cache alike (heads, dims; some may keep keys only); "
                                "this model's differ")
        keys_only = tuple(first_layer + i for i, spec in enumerate(specs)
                          if isinstance(spec, KVCacheSpec) and spec != widest)
        names = {value: name for name, value in CACHE_DTYPES.items()}
        if dtype not in names:
            raise KVLayoutError(f"KV transfer supports caches in {sorted(CACHE_DTYPES)}, not {dtype}")
        heads = dict(head_start=0, num_heads=0, total_heads=0, key_dim=0, value_dim=0)   # no KV layer here
        if kv:
            first = kv[0]
            heads = dict(head_start=first.head_start, num_heads=first.num_kv_heads,
                         total_heads=first.total_kv_heads or first.num_kv_heads, key_dim=first.key_dim,
                         value_dim=first.value_dim or 0)
        state = {}
        if states:
            spec = states[0][1]
            state = dict(state_layers=tuple(layer for layer, _ in states), conv_channels=spec.conv_channels,
                         conv_width=spec.conv_width, state_heads=spec.num_heads, state_key_dim=spec.key_dim,
                         state_value_dim=spec.value_dim)
        return cls(endpoint=endpoint, first_layer=first_layer, num_layers=len(specs), block_size=block_size,
                   dtype=names[dtype], keys_only_layers=keys_only, drafter=drafter, **heads, **state)

    @classmethod
    def _compressed(cls, specs: list, first_layer: int, block_size: int, dtype: torch.dtype,
                    endpoint: str) -> "KVShard":
        names = {value: name for name, value in CACHE_DTYPES.items()}
        if dtype not in names:
            raise KVLayoutError(f"KV transfer supports caches in {sorted(CACHE_DTYPES)}, not {dtype}")
        frames = tuple(LayerFrames(
            spec.entries_per_block(block_size),
            tuple(dim for dim in (spec.head_dim if spec.compress_rate else 0, spec.index_dim) if dim),
            tuple(shape for shape in ((spec.window_ring, spec.head_dim), (spec.carried, 2 * spec.projection_dim),
                                      (spec.carried, 2 * spec.index_projection_dim)) if shape[0] and shape[1]))
            for spec in specs)
        return cls(endpoint=endpoint, first_layer=first_layer, num_layers=len(specs), block_size=block_size,
                   dtype=names[dtype], head_start=0, num_heads=1, total_heads=1, key_dim=specs[0].head_dim,
                   value_dim=max(spec.index_dim for spec in specs),
                   state_layers=tuple(range(first_layer, first_layer + len(specs))), compressed_layers=frames)

    def frames_of(self, layer: int) -> LayerFrames | None:
        """A DeepSeek-V4 layer's frames (None for other models)."""
        return self.compressed_layers[layer - self.first_layer] if self.compressed_layers else None

    def rows_per_block(self, layer: int) -> int:
        """Rows of one block of `layer`'s cache tensors: its tokens, or a V4 layer's compressed entries."""
        frames = self.frames_of(layer)
        return self.block_size if frames is None else frames.rows

    def state_shape_of(self, layer: int) -> tuple:
        """What one sequence's state of `layer` is on this rank: equal on two ranks iff they can exchange it."""
        frames = self.frames_of(layer)
        return self.state_shape if frames is None else frames.state

    @property
    def torch_dtype(self) -> torch.dtype:
        return CACHE_DTYPES[self.dtype]

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def draft_layer(self) -> int | None:
        """The drafter's KV layer (global index: the model's layer count), if this rank holds one."""
        return self.first_layer + self.num_layers - 1 if self.drafter else None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Its layers with a paged KV cache (all but the linear-attention ones; DeepSeek-V4's with entries)."""
        if self.compressed_layers:
            return tuple(layer for layer in self.layers if self.frames_of(layer).dims)
        return tuple(layer for layer in self.layers if layer not in self.state_layers)

    @property
    def state_shape(self) -> tuple[int, ...]:
        """What one sequence's state of one layer is on this rank: equal on two ranks iff they can exchange it."""
        return (self.conv_channels, self.conv_width, self.state_heads, self.state_key_dim, self.state_value_dim)

    def holds(self, layer: int, head: int) -> bool:
        return (layer in self.kv_layers
                and self.head_start <= head < self.head_start + self.num_heads)

    def dims_of(self, layer: int) -> list[int]:
        """The channels per head of each tensor `layer`'s cache keeps: [keys] or [keys, values]."""
        frames = self.frames_of(layer)
        if frames is not None:
            return list(frames.dims)
        if self.value_dim and layer not in self.keys_only_layers:
            return [self.key_dim, self.value_dim]
        return [self.key_dim]

    def bytes_per_block(self, num_heads: int) -> int:
        """Bytes of one block of one layer for `num_heads` of its heads (keys and values: the most a layer keeps)."""
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        if self.compressed_layers:
            return max(f.rows * sum(f.dims) for f in self.compressed_layers) * num_heads * element
        return self.block_size * num_heads * (self.key_dim + self.value_dim) * element

    def bytes_per_state(self) -> int:
        """Bytes of one sequence's state of one linear layer (convolution inputs and delta-rule state)."""
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        if self.compressed_layers:
            return max(sum(math.prod(shape) for shape in f.state) for f in self.compressed_layers) * element
        return (self.conv_channels * self.conv_width * element
                + self.state_heads * self.state_key_dim * self.state_value_dim * 4)
