"""What one rank holds of a DP worker's paged KV cache, as a plain struct that travels in handles.

A prefill rank's `KVShard` names its KV block server and the slice of the cache it holds: decoder
layers [first_layer, first_layer + num_layers) (its pipeline stage) and KV heads [head_start,
head_start + num_heads) of `total_heads` (its attention-TP share; MLA's latent is one head that
every rank holds whole). A decode rank describes its own slice the same way and plans its pulls
from the prefill ranks' shards (`plan.plan_pulls`).
"""
from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from moe_runtime.layers.kv_cache import KVCacheSpec

# the cache dtypes a shard may name (a handle is untrusted input: no other name reaches torch)
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Count = Annotated[int, msgspec.Meta(ge=0, le=2**20)]
Endpoint = Annotated[str, msgspec.Meta(max_length=256)]


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

    @classmethod
    def of(cls, specs: list[KVCacheSpec], first_layer: int, block_size: int, dtype: torch.dtype,
           endpoint: str = "") -> "KVShard":
        """The shard of a rank whose owned layers have `specs` (every layer alike, as in every model here)."""
        if not specs:
            raise KVLayoutError("this rank holds no attention layer")
        first = specs[0]
        if any(spec != first for spec in specs):
            raise KVLayoutError("KV transfer needs every layer's cache alike (heads, dims); this model's differ")
        names = {value: name for name, value in CACHE_DTYPES.items()}
        if dtype not in names:
            raise KVLayoutError(f"KV transfer supports caches in {sorted(CACHE_DTYPES)}, not {dtype}")
        return cls(endpoint=endpoint, first_layer=first_layer, num_layers=len(specs), head_start=first.head_start,
                   num_heads=first.num_kv_heads, total_heads=first.total_kv_heads or first.num_kv_heads,
                   key_dim=first.key_dim, value_dim=first.value_dim or 0, block_size=block_size, dtype=names[dtype])

    @property
    def torch_dtype(self) -> torch.dtype:
        return CACHE_DTYPES[self.dtype]

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def holds(self, layer: int, head: int) -> bool:
        return layer in self.layers and self.head_start <= head < self.head_start + self.num_heads

    def bytes_per_block(self, num_heads: int) -> int:
        """Bytes of one block of one layer for `num_heads` of its heads (keys and values)."""
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        return self.block_size * num_heads * (self.key_dim + self.value_dim) * element
