"""The blocks of one KV cache group: a free list, a reference count per block, and (with prefix caching) the
content-addressed index of full blocks (`PrefixCache`), whose idle blocks count as free and are evicted,
least recently used first, when a block is needed and no plain free one is left."""
from __future__ import annotations

from collections import deque

from moe_runtime.kv_blocks.prefix_cache import PrefixCache, PrefixCacheCounters, PrefixCacheEvents
from moe_runtime.kv_blocks.prefix_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False, record_events: bool = True):
        if num_blocks < 1:
            raise ValueError(f"KV cache has {num_blocks} blocks; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))     # blocks holding nothing anyone may reuse
        self._refs = [0] * num_blocks                          # requests whose block table holds the block
        self.prefix_cache = PrefixCache(record_events) if enable_prefix_caching else None
        # with KV tiers below the pool: the cached blocks reused since the last `take_evictions` (block, hash),
        # whose bytes go down before anything overwrites them (None: nobody keeps them)
        self.evictions: list[tuple[int, BlockHash]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: plain free ones and idle cached ones (evicted when taken)."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache else 0)

    @property
    def counters(self) -> PrefixCacheCounters:
        return self.prefix_cache.counters if self.prefix_cache else PrefixCacheCounters()

    def take(self) -> int:
        """A block for new K/V, with one reference."""
        if self._free:
            block = self._free.popleft()
        else:
            evicted = self.prefix_cache.evict_lru() if self.prefix_cache else None
            if evicted is None:
                raise RuntimeError(f"no free KV block of {self.num_blocks}")
            block = evicted[0]
            if self.evictions is not None:
                self.evictions.append(evicted)
        self._refs[block] = 1
        return block

    def reference(self, block: int) -> None:
        """One more request holds the cached `block` (an idle one stops being evictable)."""
        if self._refs[block] == 0:
            self.prefix_cache.claim(block)
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """One request less holds `block`; with none left it stays cached (idle) if it holds a hash, else free."""
        self._refs[block] -= 1
        if self._refs[block] == 0 and not (self.prefix_cache is not None and self.prefix_cache.park(block)):
            self._free.append(block)

    def is_idle(self, block: int) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.is_idle(block)

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` ([] without prefix caching)."""
        return self.prefix_cache.lookup(hashes) if self.prefix_cache else []

    def cached(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, if cached."""
        found = self.lookup([block_hash])
        return found[0] if found else None

    def store(self, block: int, block_hash: BlockHash) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.store(block, block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (idle ones become free); the number of idle blocks freed."""
        if self.prefix_cache is None:
            return 0
        released = self.prefix_cache.reset()
        self._free.extend(released)
        return len(released)

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """The cached blocks reused since the last call, (block, hash), oldest first (recorded only once
        `self.evictions` is a list)."""
        if not self.evictions:
            return []
        taken, self.evictions = self.evictions, []
        return taken

    def take_events(self) -> PrefixCacheEvents | None:
        return self.prefix_cache.take_events() if self.prefix_cache else None
