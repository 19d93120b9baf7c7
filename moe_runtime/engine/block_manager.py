"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, a free list, per-sequence block tables.

With prefix caching (`PrefixCache`) a block can be shared: a request admitted with a cached prefix
references those blocks instead of computing them again, and a block whose last reference goes
away stays cached (idle) until a new block is needed and no plain free one is left. Idle blocks
count as free: `num_free_blocks` is what a request can get now. A request's `cache_salt` roots its hash
chain (`chain_root`): it shares blocks only with requests of the same salt.
"""
from __future__ import annotations

from collections import deque

from moe_runtime.engine.prefix_cache import PrefixCache, PrefixCacheCounters, PrefixCacheEvents
from moe_runtime.engine.prefix_hash import chain_root, extend_block_hashes
from moe_runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"KV cache has {num_blocks} blocks; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))     # blocks holding nothing anyone may reuse
        self._refs = [0] * num_blocks                          # requests whose block table holds the block
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: plain free ones and idle cached ones (evicted when taken)."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache else 0)

    @property
    def counters(self) -> PrefixCacheCounters:
        return self.prefix_cache.counters if self.prefix_cache else PrefixCacheCounters()

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` fresh blocks for all its tokens (no cache lookup)."""
        needed = self.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"request {seq.request_id}: needs {needed} KV blocks, {self.num_free_blocks} free")
        seq.block_table.extend(self._take_block() for _ in range(needed))

    def admit(self, seq: Sequence, read_cache: bool = True) -> bool:
        """Give a waiting `seq` blocks for all its tokens, reusing its longest cached prefix when `read_cache`
        (then only the rest needs computing: `seq.num_cached_tokens` says how much is there). False, with
        nothing changed, when the blocks do not fit."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} is admitted while holding KV blocks")
        reuse = read_cache and self.prefix_cache is not None
        hits = self._cached_prefix(seq) if reuse else []
        needed = self.blocks_needed(seq.num_tokens) - len(hits)
        idle_hits = sum(1 for block in hits if self.prefix_cache.is_idle(block))
        if needed > self.num_free_blocks - idle_hits:
            return False
        for block in hits:
            self._reference(block)
        seq.block_table = hits + [self._take_block() for _ in range(needed)]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        if reuse:
            self.prefix_cache.counters.queries += seq.num_tokens
            self.prefix_cache.counters.hits += seq.num_cached_tokens
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of `seq`'s longest cached prefix, leaving at least its last token to compute (its logits)."""
        usable = (seq.num_tokens - 1) // self.block_size
        if usable == 0:
            return []
        hashes = extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_size, usable,
                                     root=chain_root(seq.params.cache_salt))
        return self.prefix_cache.lookup(hashes[:usable])

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token (a decode step)?"""
        return self.blocks_needed(seq.num_tokens) <= len(seq.block_table) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        if self.blocks_needed(seq.num_tokens) > len(seq.block_table):
            seq.block_table.append(self._take_block())

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register `seq`'s full blocks among its first `num_computed_tokens` (computed, or computed by the
        step being scheduled, whose cache writes precede every attention read in each layer)."""
        if self.prefix_cache is None:
            return
        full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_size, full,
                                     root=chain_root(seq.params.cache_salt))
        for index in range(seq.num_registered_blocks, full):
            self.prefix_cache.store(seq.block_table[index], hashes[index])
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        # the tail first: idle blocks are evicted least recently parked first, so a prefix outlives its tails
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (idle ones become free; those in use stay with their requests,
        unshared). Returns the number of idle blocks freed."""
        if self.prefix_cache is None:
            return 0
        released = self.prefix_cache.reset()
        self._free.extend(released)
        return len(released)

    def take_cache_events(self) -> PrefixCacheEvents | None:
        """What the prefix cache stored, evicted or cleared since the last call (None: prefix caching off)."""
        return self.prefix_cache.take_events() if self.prefix_cache else None

    def _take_block(self) -> int:
        block = self._free.popleft() if self._free else self.prefix_cache.evict_lru()
        self._refs[block] = 1
        return block

    def _reference(self, block: int) -> None:
        if self._refs[block] == 0:
            self.prefix_cache.claim(block)
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0 and not (self.prefix_cache is not None and self.prefix_cache.park(block)):
            self._free.append(block)
