"""One layer's paged KV cache: [num_blocks, block_size, kv_heads, dim] tensors."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from moe_runtime.layers.attention_span import AttentionSpan


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token. `value_dim=None`: keys only (MLA latent). A DeepSeek Sparse
    Attention layer keeps its indexer's keys as the second tensor (`value_dim` = index_head_dim), beside its latent
    in the same blocks and slots (moe_runtime/layers/sparse_mla.py).

    `num_kv_heads` are this rank's, the model's heads [head_start, head_start + num_kv_heads) of
    `total_kv_heads` (attention TP splits them; MLA's one latent "head" is whole on every rank):
    what a prefill/decode transfer needs to re-shard between different head splits."""

    num_kv_heads: int
    key_dim: int
    value_dim: int | None
    head_start: int = 0
    total_kv_heads: int | None = None   # None: num_kv_heads (not split)
    span: AttentionSpan = AttentionSpan()   # which earlier tokens its queries read: picks its KV cache group

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        per_head = self.key_dim + (self.value_dim or 0)
        return self.num_kv_heads * per_head * torch.tensor([], dtype=dtype).element_size()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor for a KV cache. On CPU it lies in an anonymous memory map, whose pages the OS hands out
    zeroed on first touch: `torch.zeros` would write (and later free) every page of the whole budget up front,
    0.2 s per 256 MiB per rank at start-up and exit, and hold it all resident while most blocks are unused.
    Zero, not merely allocated, because attention multiplies masked positions' values by probability 0, and
    stale bytes may be NaN."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


@dataclass
class LayerKVCache:
    keys: torch.Tensor                 # [num_blocks, block_size, kv_heads, key_dim]
    values: torch.Tensor | None        # [num_blocks, block_size, kv_heads, value_dim] (sparse MLA: index keys)
    group: int = 0                     # its KV cache group: whose block tables and slots index it

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype, device,
                 group: int = 0) -> "LayerKVCache":
        keys = zeroed((num_blocks, block_size, spec.num_kv_heads, spec.key_dim), dtype, device)
        values = None
        if spec.value_dim is not None:
            values = zeroed((num_blocks, block_size, spec.num_kv_heads, spec.value_dim), dtype, device)
        return cls(keys, values, group)

    def write(self, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Store new tokens' keys [T, kv_heads, key_dim] (and values) at their flat slots [T]."""
        if slot_mapping.numel() == 0:
            return
        flat_keys = self.keys.view(-1, *self.keys.shape[2:])
        flat_keys.index_copy_(0, slot_mapping, keys.to(flat_keys.dtype))
        if values is not None:
            flat_values = self.values.view(-1, *self.values.shape[2:])
            flat_values.index_copy_(0, slot_mapping, values.to(flat_values.dtype))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys [S, kv_heads, key_dim] (and values) at flat slots [S]."""
        keys = self.keys.view(-1, *self.keys.shape[2:]).index_select(0, slots)
        values = None
        if self.values is not None:
            values = self.values.view(-1, *self.values.shape[2:]).index_select(0, slots)
        return keys, values
