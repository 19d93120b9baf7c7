"""A rank's bytes of one tier entry: which of its cache tensors hold a group's block or a state snapshot, and how
they are read into one flat CPU tensor and written back.

- the full group's block (`FULL_GROUP`): every full-attention layer's keys and values (MLA: its latent; sparse
  attention: its index keys, the second tensor), DeepSeek-V4's compressed entries and index keys, and a model
  drafter's rows (the MTP layer), all indexed by the full group's block ids;
- windowed group g's block: the keys and values of that group's layers, indexed by the group's own block ids;
- the state snapshot (`STATE_SNAPSHOT`): every linear-attention layer's convolution inputs and delta-rule state and
  DeepSeek-V4's rings and carried projections (a drafter's too), read from a snapshot row (state row
  `snapshot_base + row`) and written straight into the request's own slot.

Each is this rank's share only: its pipeline stage's layers, its attention-TP heads. The bytes are the tensors'
stored bytes, in order, whatever their dtypes (float32 states beside a bfloat16 cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_runtime.kv_tiers.tier_key import FULL_GROUP, STATE_SNAPSHOT
from moe_runtime.layers.compressed_cache import LayerCompressedCache
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.layers.state_cache import LayerStateCache


@dataclass(frozen=True)
class CacheTensors:
    """The tensors of one kind of entry, each indexed by block (or state row) on its first dimension."""

    tensors: tuple[torch.Tensor, ...]

    @property
    def row_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(t.shape[1:]) * t.element_size() for t in self.tensors)

    @property
    def entry_bytes(self) -> int:
        return sum(self.row_bytes)


class BlockContents:
    def __init__(self, caches: list, drafter_caches: list, snapshot_base: int, pin_memory: bool = False):
        """`caches`: the model runner's (every layer this rank owns); `drafter_caches`: a model drafter's (its KV
        layer, V4's MTP state caches); `snapshot_base`: the state row of snapshot row 0."""
        self.snapshot_base = snapshot_base
        self.pin_memory = pin_memory
        by_kind: dict[int, list[torch.Tensor]] = {}
        for cache in [*caches, *drafter_caches]:
            if isinstance(cache, LayerStateCache):
                by_kind.setdefault(STATE_SNAPSHOT, []).extend([cache.conv, cache.ssm])
            elif isinstance(cache, LayerCompressedCache):
                by_kind.setdefault(FULL_GROUP, []).extend(cache.paged_tensors())
                by_kind.setdefault(STATE_SNAPSHOT, []).extend(cache.state_tensors())
            elif isinstance(cache, LayerKVCache):
                parts = [cache.keys] if cache.values is None else [cache.keys, cache.values]
                by_kind.setdefault(cache.group, []).extend(parts)
        self.kinds = {kind: CacheTensors(tuple(tensors)) for kind, tensors in by_kind.items() if tensors}

    def entry_bytes(self) -> dict[int, int]:
        """Bytes of one entry of each kind this rank keeps."""
        return {kind: tensors.entry_bytes for kind, tensors in self.kinds.items()}

    def read(self, kind: int, indices: list[int]) -> list[torch.Tensor]:
        """One flat uint8 CPU tensor per block id (per snapshot row for `STATE_SNAPSHOT`) of `indices`, each its own
        allocation (a tier keeps entries one by one: none holds another's memory alive)."""
        tensors = self.kinds.get(kind)
        if tensors is None or not indices:
            return [torch.empty(0, dtype=torch.uint8) for _ in indices]
        rows = [index + self.snapshot_base if kind == STATE_SNAPSHOT else index for index in indices]
        entries = [torch.empty(tensors.entry_bytes, dtype=torch.uint8, pin_memory=self.pin_memory) for _ in rows]
        at = 0
        for tensor, width in zip(tensors.tensors, tensors.row_bytes):
            picked = tensor.index_select(0, torch.tensor(rows, dtype=torch.long, device=tensor.device))
            picked = picked.reshape(len(rows), -1).view(torch.uint8)                      # [N, width]
            for entry, row in zip(entries, picked):
                entry[at : at + width].copy_(row, non_blocking=True)
            at += width
        if any(t.is_cuda for t in tensors.tensors):
            torch.cuda.current_stream().synchronize()
        return entries

    def restore_row(self, row: int, slot: int) -> None:
        """Copy snapshot row `row` into state slot `slot` on the device (a request admitted with a device snapshot
        while it waits for tier loads: the row may be reused before its first step)."""
        for tensor in self.kinds.get(STATE_SNAPSHOT, CacheTensors(())).tensors:
            tensor[slot].copy_(tensor[self.snapshot_base + row])

    def write(self, kind: int, index: int, data: torch.Tensor) -> None:
        """Store `read`'s bytes of one entry into block `index` (for `STATE_SNAPSHOT`: into state slot `index`).
        Raises ValueError when the bytes are not this rank's entry size."""
        tensors = self.kinds.get(kind)
        if tensors is None:
            if data.numel():
                raise ValueError(f"{data.numel()} bytes for an entry kind {kind} this rank does not keep")
            return
        if data.numel() != tensors.entry_bytes:
            raise ValueError(f"{data.numel()} bytes for an entry of {tensors.entry_bytes}")
        at = 0
        for tensor, width in zip(tensors.tensors, tensors.row_bytes):
            part = data[at : at + width]
            # a copy of its own: a view as another dtype needs an aligned start
            part = part.to(tensor.device, non_blocking=True) if tensor.is_cuda else part.clone()
            tensor[index].copy_(part.view(tensor.dtype).view(tensor.shape[1:]))
            at += width
