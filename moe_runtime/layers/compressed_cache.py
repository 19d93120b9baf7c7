"""One DeepSeek-V4 attention layer's cache: compressed entries in the paged blocks, the rest per sequence.

A V4 layer reads, for a query at position t, the keys of its sliding window (positions t - W < p <= t; K = V) and,
on a compressing layer, the compressed entries before it: entry w sums the tokens of window w (`compress_rate`
tokens; CSA, rate 4, also the window before it) into one key, and is readable once its window is complete.

- **Compressed entries** (CSA: the entry, and the indexer's key of it; HCA: the entry) are paged in the full group's
  blocks: a block of `block_size` tokens holds the `block_size // rate` entries whose windows start in it, so the
  block table, admission, prefix caching and the cache budget treat them as they treat per-token K/V, at 1/rate of
  the bytes (`block_size` must be a multiple of every rate: the engine refuses otherwise).
- **Per-sequence state** (a state slot, moe_runtime/kv_blocks/state_slots.py, as a linear-attention layer's): the last
  `window` tokens' keys (a ring indexed by position % window), and the compressor's per-token projections (kv and
  gate, for the entry and for the indexer) of the last `carried` positions: the tokens of the window not yet
  complete, and for CSA the window before it, whose half of each token the next entry mixes in. Rings indexed by
  position % size, so a prefill cut into chunks, decode and a resumed prefix read them alike. With speculative
  decoding each ring keeps `draft_slack` more positions: a rejected draft's position then lands on a slot no later
  step reads, and an entry its window completed is computed again once the window really completes.

Rows past the slots hold prefix-cache snapshots (moe_runtime/kv_blocks/state_snapshots.py): `captures` names, per slot,
the rows to write the state into after some of the step's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_runtime.layers.kv_cache import zeroed


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """What one V4 attention layer keeps on this rank."""

    head_dim: int
    window: int                 # sliding window W
    compress_rate: int = 0      # tokens per compressed entry; 0: a sliding-only layer
    overlapping: bool = False   # CSA: each entry also mixes the window before it (carries 2 windows)
    index_dim: int = 0          # CSA: the indexer's key width (0: no indexer)
    draft_slack: int = 0        # ring positions kept beyond those read: a verify step's tokens (speculative decoding)

    @property
    def projection_dim(self) -> int:
        """The compressor's per-token kv (and gate) width: two series for an overlapping compressor."""
        return (2 if self.overlapping else 1) * self.head_dim

    @property
    def index_projection_dim(self) -> int:
        return 2 * self.index_dim if self.index_dim else 0

    @property
    def carried(self) -> int:
        """Positions of compressor projections kept per sequence."""
        if not self.compress_rate:
            return 0
        return (2 if self.overlapping else 1) * self.compress_rate + self.draft_slack

    @property
    def window_ring(self) -> int:
        """Positions of window keys kept per sequence."""
        return self.window + self.draft_slack

    def entries_per_block(self, block_size: int) -> int:
        return block_size // self.compress_rate if self.compress_rate else 0

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Paged bytes of one block (its tokens' compressed entries and index keys)."""
        return self.entries_per_block(block_size) * (self.head_dim + self.index_dim) * dtype.itemsize

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Per-sequence bytes: the window's keys and the carried projections (kv and gate)."""
        carried = self.carried * 2 * (self.projection_dim + self.index_projection_dim)
        return (self.window_ring * self.head_dim + carried) * dtype.itemsize


@dataclass
class LayerCompressedCache:
    entries: torch.Tensor | None        # [num_blocks, block_size // rate, 1, head_dim] (None: sliding only)
    index_keys: torch.Tensor | None     # [num_blocks, block_size // rate, 1, index_dim] (CSA)
    window: torch.Tensor                # [rows, W, head_dim]: keys of the last W positions, at position % W
    carry: torch.Tensor | None          # [rows, R, 2 * projection_dim]: kv | gate at position % R
    index_carry: torch.Tensor | None    # [rows, R, 2 * index_projection_dim]
    spec: CompressedAttentionSpec
    # this step's snapshots: slot -> [(tokens into the slot's sequence's step, snapshot row written after them)]
    captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def allocate(cls, spec: CompressedAttentionSpec, num_blocks: int, block_size: int, state_rows: int, dtype,
                 device) -> "LayerCompressedCache":
        per_block = spec.entries_per_block(block_size)
        entries = index_keys = carry = index_carry = None
        if spec.compress_rate:
            entries = zeroed((num_blocks, per_block, 1, spec.head_dim), dtype, device)
            carry = torch.zeros(state_rows, spec.carried, 2 * spec.projection_dim, dtype=dtype, device=device)
        if spec.index_dim:
            index_keys = zeroed((num_blocks, per_block, 1, spec.index_dim), dtype, device)
            index_carry = torch.zeros(state_rows, spec.carried, 2 * spec.index_projection_dim, dtype=dtype,
                                      device=device)
        window = torch.zeros(state_rows, spec.window_ring, spec.head_dim, dtype=dtype, device=device)
        return cls(entries, index_keys, window, carry, index_carry, spec)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.window, self.carry, self.index_carry) if t is not None]

    def paged_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries, self.index_keys) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors() + self.paged_tensors())

    def clear(self, slots: torch.Tensor) -> None:
        """Nothing to do: a sequence from its first token reads no ring position it has not written."""

    def restore(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Sequences resuming a cached prefix start from its snapshot rows (a copy on the device)."""
        for tensor in self.state_tensors():
            tensor.index_copy_(0, slots, tensor.index_select(0, rows))

    @property
    def keys(self) -> torch.Tensor | None:
        """The paged tensors as a KV transfer reads and writes blocks (moe_runtime/disaggregation/kv_transfer/
        cache_io.py): the entries, then the index keys."""
        return self.entries

    @property
    def values(self) -> torch.Tensor | None:
        return self.index_keys

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """One sequence's state tensors, copied to the CPU (a P/D transfer sends them as stored)."""
        return [t[slot].contiguous().cpu() for t in self.state_tensors()]

    def write_slot(self, slot: int, parts: list[torch.Tensor]) -> None:
        """Store one sequence's state tensors (`read_slot`'s, of this cache's shapes) into `slot`."""
        tensors = self.state_tensors()
        if [tuple(p.shape) for p in parts] != [tuple(t.shape[1:]) for t in tensors]:
            raise ValueError(f"states of shapes {[tuple(p.shape) for p in parts]} for a cache of "
                             f"{[tuple(t.shape[1:]) for t in tensors]}")
        for tensor, part in zip(tensors, parts):
            tensor[slot].copy_(part.to(device=tensor.device, dtype=tensor.dtype))

    def entry_slots(self, block_table: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """[stop - first] flat entry indices of entries [first, stop) of a sequence with `block_table` [W] int."""
        rate = self.spec.compress_rate
        per_block = self.entries.shape[1]
        starts = torch.arange(first, stop, device=block_table.device) * rate      # each window's first position
        block_size = per_block * rate
        return block_table.long()[starts // block_size] * per_block + (starts % block_size) // rate


def read_ring(ring: torch.Tensor, row: int, first: int, stop: int) -> torch.Tensor:
    """Positions [first, stop) of a ring [rows, size, ...] indexed by position % size (all within its last size)."""
    index = torch.arange(first, stop, device=ring.device) % ring.shape[1]
    return ring[row].index_select(0, index)


def write_ring(ring: torch.Tensor, row: int, values: torch.Tensor, first: int) -> None:
    """Store values [m, ...] of positions first, first + 1, ... into row `row` of a ring (only its last size)."""
    size = ring.shape[1]
    if values.shape[0] > size:
        first += values.shape[0] - size
        values = values[-size:]
    index = torch.arange(first, first + values.shape[0], device=ring.device) % size
    ring[row].index_copy_(0, index, values.to(ring.dtype))
