"""Where one sequence's KV lives on its rank: the record the block manager (`kv_blocks/`) keeps on each `Sequence`.

The block manager writes every field (admission, each step's blocks, frees); the model runner, the drafters and
the P/D halves read the tables and the state slot, and the runner consumes the state rows it copies
(`state_restore`, `state_rollback`: back to -1 once copied). It sits in records/ (below kv_blocks/ in the import
order) because `Sequence` holds it; no other package writes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceKV:
    block_table: list[int] = field(default_factory=list)          # the full KV group's blocks
    window_tables: list[list[int]] = field(default_factory=list)  # each windowed group's (-1: out of its window)
    state_slot: int = -1                           # its recurrent-state slot (linear-attention models; -1: none)
    state_restore: int = -1                        # snapshot row its slot starts from (a cached prefix; -1: none)
    state_captures: list[tuple[int, int]] = field(default_factory=list)  # this step's (boundary position, snapshot row)
    state_rollback: int = -1                       # its last verify step's rejected drafts: the slot goes back so far
    block_hashes: list[int] = field(default_factory=list)  # prefix hashes of its full blocks (prefix caching)
    num_registered_blocks: int = 0                 # leading blocks of block_table offered to the prefix cache
    prefix_hit_tokens: int = 0                     # prompt tokens its first admission found in the prefix cache
    tier_loads: list = field(default_factory=list)  # its admission's `TierLoad`s: entries of a KV tier it waits for
