"""Paged KV cache bookkeeping: fixed-size blocks, a free list, per-sequence block tables."""
from __future__ import annotations

from collections import deque

from moe_runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"KV cache has {num_blocks} blocks; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens (prefill, or recompute after preemption)."""
        needed = self.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"request {seq.request_id}: needs {needed} KV blocks, {self.num_free_blocks} free")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token (a decode step)?"""
        return self.blocks_needed(seq.num_tokens) <= len(seq.block_table) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        if self.blocks_needed(seq.num_tokens) > len(seq.block_table):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
