"""Reading and writing whole blocks of a paged layer cache, restricted to some of its KV heads.

The cache of one layer is `keys[num_blocks, block_size, heads, key_dim]` (and `values`, or None for
MLA's latent); a transfer moves blocks of it in the stored dtype and layout, so a block read here on
one instance is written there byte for byte (converted only when the two caches' dtypes differ).
"""
from __future__ import annotations

import warnings

import torch

from moe_runtime.layers.kv_cache import LayerKVCache


def read_blocks(cache: LayerKVCache, block_ids: torch.Tensor, heads: slice) -> list[torch.Tensor]:
    """Keys (and values) of `block_ids` [N], heads `heads` (local numbering): [N, block_size, h, dim], on the CPU."""
    parts = [cache.keys.index_select(0, block_ids)[:, :, heads]]
    if cache.values is not None:
        parts.append(cache.values.index_select(0, block_ids)[:, :, heads])
    return [part.contiguous().cpu() for part in parts]


def write_blocks(cache: LayerKVCache, block_ids: torch.Tensor, heads: slice, parts: list[torch.Tensor]) -> None:
    """Store `parts` (keys [, values], each [N, block_size, h, dim]) into blocks `block_ids` [N], heads `heads`."""
    targets = [cache.keys] if cache.values is None else [cache.keys, cache.values]
    if len(parts) != len(targets):
        raise ValueError(f"{len(parts)} tensors for a cache of {len(targets)}")
    ids = block_ids.to(cache.keys.device)
    for target, part in zip(targets, parts):
        target[:, :, heads].index_copy_(0, ids, part.to(device=target.device, dtype=target.dtype))


def as_frame(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def from_frame(buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` over `buffer`'s bytes, without a copy. The buffer is read-only (a received frame)
    and the tensor is only read, copied into the cache: torch's warning about that is silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
