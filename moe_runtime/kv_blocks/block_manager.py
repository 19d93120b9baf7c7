"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, a free list, per-sequence block tables.

With prefix caching (`PrefixCache`) a block can be shared: a request admitted with a cached prefix
references those blocks instead of computing them again, and a block whose last reference goes
away stays cached (idle) until a new block is needed and no plain free one is left. Idle blocks
count as free: `num_free_blocks` is what a request can get now. A request's `cache_salt` roots its hash
chain (`chain_root`): it shares blocks only with requests of the same salt.

A model with windowed layers beside full ones (moe_runtime/kv_blocks/kv_groups.py) has one more group per
window: `seq.kv.block_table` is the full group's, `seq.kv.window_tables[i]` windowed group i + 1's
(moe_runtime/kv_blocks/window_blocks.py), prepared for each scheduled step (`schedule_tokens`). A cached
prefix is reused only as far as every windowed group still holds the window its first new query reads.

A model with linear-attention layers (`state_slots`) gives each admitted sequence a recurrent-state slot
(moe_runtime/kv_blocks/state_slots.py), freed with its blocks. With prefix caching it also keeps state snapshots at
full-block boundaries (moe_runtime/kv_blocks/state_snapshots.py) under the full blocks' hashes: a cached prefix is
reused only as far as a snapshot of its end is kept, and each scheduled step asks for snapshots of the block
boundaries it computes (`seq.kv.state_captures`).

With KV tiers below the device pool (`attach_tiers`, moe_runtime/kv_tiers/engine_tiers.py) a cached block or snapshot
the pool reuses is recorded (`take_evictions`: its bytes go down before the step overwrites them), and a prefix is
looked up past the device's blocks in the tiers too: the full group's blocks, each windowed group's window and the
state snapshot at its end may each come from either. What comes from a tier gets fresh blocks (its slot, for the
snapshot) and a `TierLoad` each (`seq.kv.tier_loads`): the scheduler holds the request until they are back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from moe_runtime.kv_blocks.block_pool import BlockPool
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheCounters, PrefixCacheEvents
from moe_runtime.kv_blocks.prefix_hash import BlockHash, chain_root, extend_block_hashes
from moe_runtime.records.sequence import Sequence
from moe_runtime.kv_blocks.state_slots import StateSlots
from moe_runtime.kv_blocks.state_snapshots import SnapshotPoolSize, StateSnapshots
from moe_runtime.kv_blocks.window_blocks import WindowBlocks
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, STATE_SNAPSHOT, TierKey
from moe_runtime.kv_tiers.tier_moves import TierLoad, TierSave
from moe_runtime.layers.attention_span import AttentionSpan


class TierLookup(Protocol):
    def holds(self, key: TierKey) -> bool:
        """Whether a tier below the device pool holds `key`'s entry."""


@dataclass
class CachedPrefix:
    """What a waiting sequence can reuse: `blocks` on the device, then `tier_hashes` (the full group's blocks after
    them) from the tiers; each windowed group's table (FROM_TIER entries from the tiers); the state snapshot's row
    (-1: none, or `state_from_tier`)."""

    blocks: list[int] = field(default_factory=list)
    tier_hashes: list[BlockHash] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)
    restore: int = -1
    state_from_tier: bool = False
    hashes: list[BlockHash] = field(default_factory=list)    # the sequence's hashes, at least up to the prefix's end

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.tier_hashes)


class BlockManager:
    """`windows`: (span, pool blocks) of each windowed group, in group order (none: one group); `state_slots`:
    recurrent-state slots of a model with linear-attention layers (0: none), whose snapshots
    (`SnapshotPoolSize`) are kept when prefix caching is on."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 windows: tuple[tuple[AttentionSpan, int], ...] = (), state_slots: int = 0):
        self.states = StateSlots(state_slots) if state_slots else None
        self.snapshots = (StateSnapshots(SnapshotPoolSize().of(state_slots))
                          if state_slots and enable_prefix_caching else None)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache = self.pool.prefix_cache
        self.windows = [WindowBlocks(span, blocks, block_size, enable_prefix_caching) for span, blocks in windows]
        self.tiers: TierLookup | None = None
        self.tier_hit_tokens = 0    # prompt tokens admissions found in the tiers (not on the device), cumulative

    def attach_tiers(self, tiers: TierLookup) -> None:
        """Look prefixes up in `tiers` too, and record every cached block or snapshot the device pool reuses."""
        if self.prefix_cache is None:
            return
        self.tiers = tiers
        self.pool.evictions = []
        for window in self.windows:
            window.pool.evictions = []
        if self.snapshots is not None:
            self.snapshots.evictions = []

    def cached_entries(self) -> list[TierSave]:
        """Every idle cached block and written snapshot as a save, least recently used first (what a disk tier keeps at
        shutdown)."""
        if self.prefix_cache is None:
            return []
        saves = [TierSave(TierKey(FULL_GROUP, h), block) for block, h in self.prefix_cache.idle_blocks()]
        for group, window in enumerate(self.windows, start=1):
            saves += [TierSave(TierKey(group, h), block) for block, h in window.pool.prefix_cache.idle_blocks()]
        if self.snapshots is not None:
            saves += [TierSave(TierKey(STATE_SNAPSHOT, h), row) for row, h in self.snapshots.cached_rows()]
        return saves

    def take_evictions(self) -> list[TierSave]:
        """The cached blocks and snapshots reused since the last call: their bytes must go down now."""
        saves = [TierSave(TierKey(FULL_GROUP, h), block) for block, h in self.pool.take_evictions()]
        for group, window in enumerate(self.windows, start=1):
            saves += [TierSave(TierKey(group, h), block) for block, h in window.pool.take_evictions()]
        if self.snapshots is not None:
            saves += [TierSave(TierKey(STATE_SNAPSHOT, h), row) for row, h in self.snapshots.take_evictions()]
        return saves

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: plain free ones and idle cached ones (evicted when taken)."""
        return self.pool.num_free_blocks

    @property
    def counters(self) -> PrefixCacheCounters:
        return self.pool.counters

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.num_tokens) - len(seq.kv.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` fresh blocks for all its tokens (no cache lookup; its windowed groups those its uncomputed
        tokens read and write)."""
        needed = self.blocks_needed(seq.num_tokens) - len(seq.kv.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"request {seq.request_id}: needs {needed} KV blocks, {self.num_free_blocks} free")
        seq.kv.block_table.extend(self.pool.take() for _ in range(needed))
        if self.states is not None and seq.kv.state_slot < 0:
            seq.kv.state_slot = self.states.take()
        if len(seq.kv.window_tables) != len(self.windows):
            seq.kv.window_tables = [[] for _ in self.windows]
        for window, table in zip(self.windows, seq.kv.window_tables):
            window.prepare(table, seq.num_cached_tokens, seq.num_tokens)

    def admit(self, seq: Sequence, read_cache: bool = True) -> bool:
        """Give a waiting `seq` blocks for all its tokens, reusing its longest cached prefix when `read_cache`
        (then only the rest needs computing: `seq.num_cached_tokens` says how much is there). False, with
        nothing changed, when the blocks do not fit."""
        if seq.kv.block_table:
            raise RuntimeError(f"request {seq.request_id} is admitted while holding KV blocks")
        reuse = read_cache and self.prefix_cache is not None
        prefix = self._cached_prefix(seq) if reuse else CachedPrefix(window_tables=[[] for _ in self.windows])
        hits = prefix.blocks
        needed = self.blocks_needed(seq.num_tokens) - len(hits)
        idle_hits = sum(1 for block in hits if self.pool.is_idle(block))
        if needed > self.num_free_blocks - idle_hits or (self.states is not None and self.states.num_free == 0):
            return False
        if self.states is not None:
            seq.kv.state_slot = self.states.take()
        if prefix.restore >= 0:
            self.snapshots.use(prefix.restore)
        seq.kv.state_restore = prefix.restore
        for block in hits:
            self.pool.reference(block)
        seq.kv.block_table = hits + [self.pool.take() for _ in range(needed)]
        loads = [TierLoad(TierKey(FULL_GROUP, block_hash), seq.kv.block_table[len(hits) + i])
                 for i, block_hash in enumerate(prefix.tier_hashes)]
        for group, (window, table) in enumerate(zip(self.windows, prefix.window_tables), start=1):
            loads += [TierLoad(TierKey(group, prefix.hashes[index]), table[index]) for index in window.adopt(table)]
        if prefix.state_from_tier:
            loads.append(TierLoad(TierKey(STATE_SNAPSHOT, prefix.hashes[prefix.num_blocks - 1]), seq.kv.state_slot))
        seq.kv.tier_loads = loads
        seq.kv.window_tables = prefix.window_tables
        seq.num_cached_tokens = prefix.num_blocks * self.block_size
        seq.kv.num_registered_blocks = len(hits)   # blocks loaded from a tier are offered once they are back
        if not seq.output_token_ids:   # its first admission: a preempted request's recompute is not a cache hit
            seq.kv.prefix_hit_tokens = seq.num_cached_tokens
        if reuse:
            self.prefix_cache.counters.queries += seq.num_tokens
            self.prefix_cache.counters.hits += seq.num_cached_tokens
            self.tier_hit_tokens += len(prefix.tier_hashes) * self.block_size
        return True

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """`seq`'s longest reusable prefix, leaving at least its last token to compute (its logits): its full
        group's blocks on the device then in the tiers, each windowed group's window after it, and the state
        snapshot of its end (device or tier), all present."""
        usable = (seq.num_tokens - 1) // self.block_size
        none = CachedPrefix(window_tables=[[] for _ in self.windows])
        if usable == 0:
            return none
        hashes = extend_block_hashes(seq.kv.block_hashes, seq.all_token_ids, self.block_size, usable,
                                     root=chain_root(seq.params.cache_salt))
        hits = self.pool.lookup(hashes[:usable])
        deepest = len(hits)
        if self.tiers is not None:
            while deepest < usable and self.tiers.holds(TierKey(FULL_GROUP, hashes[deepest])):
                deepest += 1
        for length in range(deepest, 0, -1):
            restore, state_from_tier = -1, False
            if self.snapshots is not None:
                restore = self.snapshots.lookup(hashes[length - 1])
                if restore is None:
                    if self.tiers is None or not self.tiers.holds(TierKey(STATE_SNAPSHOT, hashes[length - 1])):
                        continue
                    restore, state_from_tier = -1, True
            tables = [window.cached_window(hashes, length, self._in_tier(group))
                      for group, window in enumerate(self.windows, start=1)]
            if all(table is not None for table in tables):
                device = hits[:length]
                return CachedPrefix(device, hashes[len(device):length], tables, restore, state_from_tier, hashes)
        return none

    def _in_tier(self, group: int):
        """Whether windowed group `group`'s block of a hash is in a tier (None: no tiers)."""
        if self.tiers is None:
            return None
        return lambda block_hash: self.tiers.holds(TierKey(group, block_hash))

    def can_append(self, seq: Sequence, drafts: int = 0) -> bool:
        """Room for its next token (a decode step), and `drafts` more after it (speculation)?"""
        return self.blocks_needed(seq.num_tokens + drafts) - len(seq.kv.block_table) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, drafts: int = 0) -> None:
        while self.blocks_needed(seq.num_tokens + drafts) > len(seq.kv.block_table):
            seq.kv.block_table.append(self.pool.take())

    def roll_back(self, seq: Sequence) -> None:
        """Forget the K/V of its rejected drafts: the cache holds every token but its last (the one it sampled
        last), and the blocks past those are freed, in every group. Their K/V content is simply overwritten
        later; none of them was offered to the prefix cache (`schedule_tokens` registers tokens, never drafts).
        Recurrent states cannot be cut: the sequence's next step starts its slot from the checkpoint before the
        rejected tokens (`seq.kv.state_rollback`, moe_runtime/records/draft_checkpoints.py)."""
        rejected = seq.num_cached_tokens - (seq.num_tokens - 1)
        if rejected > 0 and self.states is not None:
            seq.kv.state_rollback = rejected
        seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
        keep = self.blocks_needed(seq.num_tokens)
        for block in reversed(seq.kv.block_table[keep:]):
            self.pool.release(block)
        del seq.kv.block_table[keep:]
        for window, table in zip(self.windows, seq.kv.window_tables):
            window.truncate(table, keep)

    def schedule_tokens(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` computes its next `num_tokens` in the step being scheduled: its windowed groups hold the blocks
        the step reads and writes (releasing those behind the window), and the full blocks it completes are
        registered for reuse."""
        first = seq.num_cached_tokens
        if len(seq.kv.window_tables) != len(self.windows):
            seq.kv.window_tables = [[] for _ in self.windows]
        for window, table in zip(self.windows, seq.kv.window_tables):
            window.prepare(table, first, first + num_tokens)
        computed = min(first + num_tokens, seq.num_tokens)   # drafts are not cached
        if self._forces_routing(seq):
            return   # its KV (and states) follow the forced routing, not the model's: no later prefix may reuse them
        self.cache_full_blocks(seq, computed)
        if self.snapshots is not None:   # boundaries of true tokens only: a state past a draft is no prefix's
            self._capture_states(seq, first, computed)

    @staticmethod
    def _forces_routing(seq: Sequence) -> bool:
        """Whether `seq` forces its routing (`forced_routed_experts`): from the second MoE layer on its KV was
        computed under that routing, so its blocks are never registered (nor reach the KV tiers), under any salt."""
        return seq.routing is not None and seq.routing.forced is not None

    def _capture_states(self, seq: Sequence, first: int, stop: int) -> None:
        """Snapshot rows for the full-block boundaries in (first, stop] that the step computes (in order, while
        rows are free or idle): the layers write each there during the step (`seq.kv.state_captures`)."""
        bs = self.block_size
        boundaries = range((first // bs + 1) * bs, stop + 1, bs)
        seq.kv.state_captures = []
        if not boundaries:
            return
        hashes = extend_block_hashes(seq.kv.block_hashes, seq.all_token_ids, bs, stop // bs,
                                     root=chain_root(seq.params.cache_salt))
        for position in boundaries:
            row = self.snapshots.capture(seq, position, hashes[position // bs - 1])
            if row is not None:
                seq.kv.state_captures.append((position, row))

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register `seq`'s full blocks among its first `num_computed_tokens` (computed, or computed by the
        step being scheduled, whose cache writes precede every attention read in each layer)."""
        if self.prefix_cache is None or self._forces_routing(seq):
            return
        full = min(num_computed_tokens // self.block_size, len(seq.kv.block_table))
        if full <= seq.kv.num_registered_blocks:
            return
        hashes = extend_block_hashes(seq.kv.block_hashes, seq.all_token_ids, self.block_size, full,
                                     root=chain_root(seq.params.cache_salt))
        for index in range(seq.kv.num_registered_blocks, full):
            self.pool.store(seq.kv.block_table[index], hashes[index])
        for window, table in zip(self.windows, seq.kv.window_tables):
            window.register(table, hashes, seq.kv.num_registered_blocks, min(full, len(table)))
        seq.kv.num_registered_blocks = full

    def window_blocks_held(self, seq: Sequence) -> list[int]:
        """Blocks `seq` holds in each windowed group."""
        return [WindowBlocks.held(table) for table in seq.kv.window_tables]

    def free(self, seq: Sequence) -> None:
        # the tail first: idle blocks are evicted least recently parked first, so a prefix outlives its tails
        for block in reversed(seq.kv.block_table):
            self.pool.release(block)
        for window, table in zip(self.windows, seq.kv.window_tables):
            window.release(table)
        if self.states is not None and seq.kv.state_slot >= 0:
            self.states.release(seq.kv.state_slot)
        if self.snapshots is not None:
            self.snapshots.forget_pending(seq)
        seq.kv.state_slot = -1
        seq.kv.state_restore = -1
        seq.kv.state_rollback = -1
        seq.kv.state_captures = []
        seq.kv.tier_loads = []
        seq.kv.block_table = []
        seq.drafts.token_ids = []
        seq.kv.window_tables = []
        seq.num_cached_tokens = 0
        seq.kv.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (idle ones become free; those in use stay with their requests,
        unshared). Returns the number of the full group's idle blocks freed."""
        for window in self.windows:
            window.pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset()
        return self.pool.reset_prefix_cache()

    def take_cache_events(self) -> PrefixCacheEvents | None:
        """What the prefix cache stored, evicted or cleared since the last call (None: prefix caching off)."""
        return self.pool.take_events()
