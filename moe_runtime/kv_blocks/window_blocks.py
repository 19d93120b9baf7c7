"""One windowed KV group's blocks: each sequence's table over the group's pool, holding only the blocks a
step can still read (moe_runtime/kv_blocks/kv_groups.py says why the pool never runs dry).

A sequence's table has one entry per block of its positions, like the full group's; an entry is -1 once no
future query can read that block (the runner points it at the group's scratch block, `scratch_block`). With
prefix caching a full block is registered under the same prefix hash as the full group's block of the same
positions, and a block that leaves the window stays cached (idle) until its memory is needed: a request
sharing the prefix finds the window its first query reads (`cached_window`).
"""
from __future__ import annotations

from typing import Callable

from moe_runtime.kv_blocks.block_pool import BlockPool
from moe_runtime.kv_blocks.prefix_hash import BlockHash
from moe_runtime.layers.attention_span import AttentionSpan

FREED = -1
FROM_TIER = -2   # `cached_window`: a block of the window a KV tier holds (the admission loads it into a fresh block)


class WindowBlocks:
    def __init__(self, span: AttentionSpan, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.span = span
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_events=False)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def scratch_block(self) -> int:
        """The block past the pool that freed entries read (allocated with the group's caches, never handed out)."""
        return self.pool.num_blocks

    def first_block_read(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads."""
        return self.span.first_needed(position) // self.block_size

    def prepare(self, table: list[int], first: int, stop: int) -> None:
        """Before a step computes positions [first, stop): hold the blocks its queries read and write, release
        the ones before the first key any of them (or a later query) reads."""
        keep_from = self.first_block_read(first)
        # held entries are one run [lo, len): find lo walking back from keep_from to the freed prefix, then release
        # oldest first (a step's cost follows the window, not the sequence's length)
        released_stop = min(keep_from, len(table))
        lo = released_stop
        while lo > 0 and table[lo - 1] != FREED:
            lo -= 1
        for index in range(lo, released_stop):
            self.pool.release(table[index])
            table[index] = FREED
        needed = -(-stop // self.block_size)
        while len(table) < needed:
            table.append(FREED)
        for index in range(keep_from, needed):
            if table[index] == FREED:
                if self.pool.num_free_blocks == 0:
                    raise RuntimeError(f"the {self.span.kind} window pool of {self.num_blocks} blocks is empty: it "
                                       "is sized for the worst step, so a sequence holds more than its window")
                table[index] = self.pool.take()

    def cached_window(self, hashes: list[BlockHash], num_blocks: int,
                      in_tier: Callable[[BlockHash], bool] | None = None) -> list[int] | None:
        """The cached blocks a query at position num_blocks * block_size reads, as the start of a table
        (FREED before them; FROM_TIER for one a KV tier holds, with `in_tier`); None when one of them is in neither."""
        first = self.first_block_read(num_blocks * self.block_size)
        window = []
        for index in range(first, num_blocks):
            block = self.pool.cached(hashes[index])
            if block is None and in_tier is not None and in_tier(hashes[index]):
                block = FROM_TIER
            if block is None:
                return None
            window.append(block)
        return [FREED] * first + window

    def adopt(self, table: list[int]) -> list[int]:
        """A sequence starts with these cached blocks (from `cached_window`): hold a reference to each, and give a
        fresh block to each FROM_TIER entry (after the references: a fresh block never evicts one of the window's);
        the indices of those, for their loads."""
        for block in table:
            if block >= 0:
                self.pool.reference(block)
        from_tier = [index for index, block in enumerate(table) if block == FROM_TIER]
        for index in from_tier:
            table[index] = self.pool.take()
        return from_tier

    def register(self, table: list[int], hashes: list[BlockHash], registered: int, full: int) -> None:
        """Offer the table's held blocks [registered, full) (full blocks computed, or computed this step)."""
        for index in range(registered, full):
            if table[index] != FREED:
                self.pool.store(table[index], hashes[index])

    def truncate(self, table: list[int], keep: int) -> None:
        """Give back the blocks past the table's first `keep` entries (a sequence's rejected drafts)."""
        for block in reversed(table[keep:]):
            if block != FREED:
                self.pool.release(block)
        del table[keep:]

    def release(self, table: list[int]) -> None:
        """Give back every block of a finished or preempted sequence (cached ones stay cached, idle)."""
        for block in reversed(table):
            if block != FREED:
                self.pool.release(block)
        table.clear()

    @staticmethod
    def held(table: list[int]) -> int:
        return sum(1 for block in table if block != FREED)
