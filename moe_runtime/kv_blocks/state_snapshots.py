"""Prefix caching for linear-attention layers: recurrent-state snapshots at full-block boundaries.

A cached prefix of a hybrid model (Qwen3-Next, Qwen3.5-MoE) is reusable only if its Gated DeltaNet layers can
resume too: their state after the prefix's last token (the convolution's last K-1 inputs and the delta-rule
matrix) must be kept, since it cannot be rebuilt from the full layers' K/V. So, as SGLang and vLLM do for hybrid
models, the block manager keeps snapshots of a sequence's states at full-block boundaries of its computed
prefix, registered under the same prefix hash as the full group's block that ends there; a prefix is reused up
to the longest boundary where both the full group's blocks and a snapshot are cached (`BlockManager.admit`), and
the sequence's state slot starts as a device copy of that snapshot instead of zeros.

This is the bookkeeping (which snapshot row holds which hash, LRU over the idle ones); the rows are extra rows
of every linear layer's state tensors, after the slots and their scratch row (moe_runtime/layers/state_cache.py,
moe_runtime/execution/model_runner.py). A snapshot is taken by the step that computes its boundary's token
(`capture`), written by the layers during that step's forward (gated_deltanet.py splits the chunk there), and
readable only once that step ran (`pending` until its sequence's computed tokens reach it), so a request admitted
in the same step never copies a row not written yet. A pending row is never evicted (two captures of one step
cannot share a row); a capture finding no free or idle row is skipped: a shorter prefix, or none, is reused.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from moe_runtime.kv_blocks.prefix_hash import BlockHash
from moe_runtime.records.sequence import Sequence


@dataclass(frozen=True)
class SnapshotPoolSize:
    """How many snapshots the pool holds: `per_slot` per recurrent-state slot (max_num_seqs slots). Each costs
    what a slot costs (every linear layer's conv + delta-rule state on this rank) and is paid from the KV budget
    before the blocks, like the slots (`kv_blocks_for_budget`). A count every rank derives alike from numbers
    they agree on, so their block managers admit alike whatever their pipeline stage's layers."""

    per_slot: int = 1

    def of(self, state_slots: int) -> int:
        return self.per_slot * state_slots


@dataclass
class PendingSnapshot:
    owner: Sequence         # the sequence whose step writes it
    position: int           # the boundary: its state after `position` tokens
    block_hash: BlockHash


class StateSnapshots:
    def __init__(self, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self._free: deque[int] = deque(range(num_snapshots))
        self._row_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()   # written snapshots, least recently used first
        self._pending: dict[int, PendingSnapshot] = {}       # row -> being written by its owner's scheduled step
        # with KV tiers: written snapshots whose rows were reused since the last `take_evictions` (row, hash), read
        # down before the step overwrites them (None: nobody keeps them)
        self.evictions: list[tuple[int, BlockHash]] | None = None

    @property
    def num_cached(self) -> int:
        return len(self._idle)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The written snapshot of the prefix ending with `block_hash` (None: none yet)."""
        self._settle()
        row = self._row_of.get(block_hash)
        return row if row is not None and row in self._idle else None

    def use(self, row: int) -> None:
        """A request resumes from `row` (copied into its slot before its first step): most recently used."""
        self._idle.move_to_end(row)

    def capture(self, seq: Sequence, position: int, block_hash: BlockHash) -> int | None:
        """A row for `seq`'s state after `position` tokens, which its scheduled step computes (None: that prefix
        has a snapshot already, or no row is free or idle)."""
        if block_hash in self._row_of:
            return None
        self._settle()   # rows an earlier step wrote are idle now: reusable (a chunked prefill's later boundaries)
        if self._free:
            row = self._free.popleft()
        elif self._idle:
            row, _ = self._idle.popitem(last=False)
            evicted_hash = self._hash_of.pop(row)
            del self._row_of[evicted_hash]
            if self.evictions is not None:
                self.evictions.append((row, evicted_hash))
        else:
            return None
        self._row_of[block_hash] = row
        self._hash_of[row] = block_hash
        self._pending[row] = PendingSnapshot(seq, position, block_hash)
        return row

    def _settle(self) -> None:
        """Pending snapshots whose step ran become readable, the longer prefixes older: a shared shorter prefix
        outlives them (as `BlockManager.free` parks a prefix's tail first)."""
        done = [row for row, p in self._pending.items() if p.owner.num_cached_tokens >= p.position]
        for row in sorted(done, key=lambda r: -self._pending[r].position):
            del self._pending[row]
            self._idle[row] = None

    def cached_rows(self) -> list[tuple[int, BlockHash]]:
        """Every written snapshot and its hash, least recently used first."""
        self._settle()
        return [(row, self._hash_of[row]) for row in self._idle]

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """The written snapshots whose rows were reused since the last call, (row, hash)."""
        if not self.evictions:
            return []
        taken, self.evictions = self.evictions, []
        return taken

    def forget_pending(self, seq: Sequence) -> None:
        """`seq` leaves (finished, preempted): what its steps wrote is kept, what no step wrote is dropped."""
        self._settle()
        for row in [row for row, p in self._pending.items() if p.owner is seq]:
            del self._pending[row]
            del self._row_of[self._hash_of.pop(row)]
            self._free.append(row)

    def reset(self) -> int:
        """Forget every written snapshot (rows being written stay with their steps); the number forgotten."""
        self._settle()
        dropped = list(self._idle)
        for row in dropped:
            del self._row_of[self._hash_of.pop(row)]
            self._free.append(row)
        self._idle.clear()
        return len(dropped)
