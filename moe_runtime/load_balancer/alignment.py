"""Relabel a fresh placement's ranks and slots to overlap an existing one.

A packing decides which experts share a rank, not which rank that is: any
permutation of ranks (within nodes, and of whole nodes, in hierarchical mode)
and any order of slots inside a rank balances equally well. Choosing the
permutation that overlaps the placement in force turns "recompute from
scratch" into "move only what changed".
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from moe_runtime.load_balancer.slot_geometry import SlotGeometry


def align_to_previous(
    new: np.ndarray,  # [P] expert of each slot, fresh
    previous: np.ndarray,  # [P] expert of each slot, in force
    num_experts: int,
    num_ranks: int,
    ranks_per_node: Optional[int] = None,  # set: only permute whole nodes and ranks within them
) -> np.ndarray:
    """[P]: `new` with ranks permuted and slots reordered to keep most slots unchanged."""
    geometry = SlotGeometry(new.shape[0], num_ranks)
    new_count = _rank_counts(new, num_experts, num_ranks)  # [E, W]
    prev_count = _rank_counts(previous, num_experts, num_ranks)  # [E, W]
    # overlap[i, j]: experts bin i of `new` could keep in place on rank j of `previous`.
    overlap = np.minimum(new_count[:, :, None], prev_count[:, None, :]).sum(0)  # [W, W]
    if ranks_per_node is None or ranks_per_node == num_ranks:
        rank_map = _greedy_match(overlap)
    else:
        num_nodes = num_ranks // ranks_per_node
        node_overlap = overlap.reshape(num_nodes, ranks_per_node, num_nodes, ranks_per_node).sum((1, 3))
        node_map = _greedy_match(node_overlap)
        rank_map = np.empty(num_ranks, dtype=np.int64)
        for new_node, prev_node in enumerate(node_map):
            rows = slice(new_node * ranks_per_node, (new_node + 1) * ranks_per_node)
            cols = slice(prev_node * ranks_per_node, (prev_node + 1) * ranks_per_node)
            rank_map[rows] = _greedy_match(overlap[rows, cols]) + prev_node * ranks_per_node
    out = np.empty_like(new)
    for new_rank, prev_rank in enumerate(rank_map):
        experts = list(new[geometry.rank_slots(new_rank)])
        slots = geometry.rank_slots(prev_rank)
        free = []
        for slot in slots:  # keep experts already in this slot
            if previous[slot] in experts:
                experts.remove(previous[slot])
                out[slot] = previous[slot]
            else:
                free.append(slot)
        for slot, expert in zip(free, experts):
            out[slot] = expert
    return out


def _rank_counts(slot_expert: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    rank = SlotGeometry(slot_expert.shape[0], num_ranks).slot_ranks()  # [P]
    counts = np.zeros((num_experts, num_ranks), dtype=np.int64)
    np.add.at(counts, (slot_expert, rank), 1)
    return counts


def _greedy_match(score: np.ndarray) -> np.ndarray:
    """[n] column matched to each row of a square score matrix, largest scores first."""
    n = score.shape[0]
    match = np.full(n, -1, dtype=np.int64)
    work = score.astype(np.float64).copy()
    for _ in range(n):
        row, col = np.unravel_index(int(np.argmax(work)), work.shape)
        match[row] = col
        work[row, :] = -np.inf
        work[:, col] = -np.inf
    return match
