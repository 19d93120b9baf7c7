"""The content-addressed side of the KV cache: which physical block holds which full block of tokens.

A full block whose K/V has been computed (or is being computed in the current step, ahead of any
reader in that step) is registered under its prefix hash (`moe_runtime.kv_blocks.prefix_hash`). A block no
request references stays cached, idle, until its memory is needed: the block manager then takes
the least recently used idle block (`evict_lru`). A request that starts with cached blocks reuses
them (the block manager counts references) and computes only the rest.

Every change is recorded as the net effect per hash since the last `take_events()`, so the DP
worker can tell the front's cache-aware router what it holds without sending the whole index.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from moe_runtime.kv_blocks.prefix_hash import BlockHash


@dataclass
class PrefixCacheEvents:
    """What changed in one DP worker's prefix cache since its previous report.

    Apply `cleared` first (forget every hash of this worker), then `evicted`, then `stored`; a hash
    is in at most one of the lists (its last change wins), so the order of the lists is exact.
    """

    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted or self.cleared)


@dataclass
class PrefixCacheCounters:
    """Lookups since start, in tokens: `queries` tokens looked up, `hits` of them found cached."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """`record_events=False`: keep no change log (a windowed group's cache, which no router is told about)."""

    def __init__(self, record_events: bool = True) -> None:
        self.record_events = record_events
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()   # cached blocks nobody uses, least recently used first
        self._changes: dict[BlockHash, bool] = {}            # since the last report: stored (True) / evicted (False)
        self._cleared = False
        self.counters = PrefixCacheCounters()

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (block i holds the block hashed hashes[i])."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def claim(self, block: int) -> None:
        """A request takes a reference to an idle cached block: it is no longer evictable."""
        del self._idle[block]

    def store(self, block: int, block_hash: BlockHash) -> bool:
        """Register `block` as holding `block_hash`; False when another block already holds it (then this
        one stays private to its request: two requests computed the same prefix in one step)."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        if self.record_events:
            self._changes[block_hash] = True
        return True

    def park(self, block: int) -> bool:
        """The last reference to `block` went away: keep it as an idle cached block if it holds a hash
        (True), else it is plain free memory (False)."""
        if block not in self._hash_of:
            return False
        self._idle[block] = None
        return True

    def evict_lru(self) -> tuple[int, BlockHash] | None:
        """Forget the least recently used idle block: (it, for reuse, and the hash it held); None: no idle block."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        if self.record_events:
            self._changes[block_hash] = False
        return block, block_hash

    def idle_blocks(self) -> list[tuple[int, BlockHash]]:
        """The idle cached blocks and their hashes, least recently used first (computed: a block in use may belong to
        a step that has not run)."""
        return [(block, self._hash_of[block]) for block in self._idle]

    def reset(self) -> list[int]:
        """Forget every hash; returns the idle blocks, now plain free memory. Blocks in use stay with their
        requests, unshared."""
        released = list(self._idle)
        self._idle.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._changes.clear()
        self._cleared = True
        return released

    def take_events(self) -> PrefixCacheEvents:
        """The net changes since the previous call (empty when nothing changed)."""
        events = PrefixCacheEvents([h for h, stored in self._changes.items() if stored],
                                   [h for h, stored in self._changes.items() if not stored], self._cleared)
        self._changes = {}
        self._cleared = False
        return events
