"""Replicate hot experts and pack slots onto ranks so per-rank load is even.

Per layer, three candidates compete when a placement is already in force:
- keep it (0 experts moved);
- improve it in place with local search, stopping at the point of the search
  path where (balancedness - min_gain_per_move * experts moved) is best;
- a fresh placement (greedy replication + balanced packing + local search),
  relabelled to overlap the placement in force.
The winner maximises balancedness - min_gain_per_move * experts moved, so an
expert is moved only when it buys at least `min_gain_per_move` balancedness.
The default scales with 1 / num_ranks: copies to different ranks run in
parallel, so one copy per rank (one "copy round") must buy
DEFAULT_GAIN_PER_COPY_ROUND balancedness.

Hierarchical mode (num_groups given, num_nodes > 1, groups divisible by nodes):
whole expert groups are packed onto nodes first and every replica of an expert
stays on its group's node, so group-limited routing (DeepSeek n_group /
topk_group) keeps its traffic inside few nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from load_balancer.alignment import align_to_previous
from load_balancer.balancedness import check_load
from load_balancer.local_search import LayerSearch
from load_balancer.packing import balanced_pack
from load_balancer.placement import Placement, RebalanceStats, check_layout
from load_balancer.replication import greedy_replica_counts

logger = logging.getLogger(__name__)

DEFAULT_GAIN_PER_COPY_ROUND = 0.005


@dataclass(frozen=True)
class Layout:
    """Sizes and the node structure one layer's placement must respect."""

    num_experts: int
    num_slots: int
    num_ranks: int
    num_nodes: int
    num_groups: Optional[int]  # None: global placement (replicas may cross nodes)

    @property
    def hierarchical(self) -> bool:
        return self.num_groups is not None

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def max_replicas(self) -> int:
        return self.ranks_per_node if self.hierarchical else self.num_ranks


def rebalance(
    load: torch.Tensor,  # [L, E] recent tokens per logical expert
    num_slots: int,
    num_ranks: int,
    num_nodes: int = 1,
    previous: Optional[Placement] = None,
    *,
    num_groups: Optional[int] = None,
    min_gain_per_move: Optional[float] = None,
    max_search_steps: Optional[int] = None,
) -> Placement:
    """New placement for `load`; with `previous`, moves only experts that pay.

    min_gain_per_move: balancedness (mean/max per-rank load, per layer) an
    expert move must buy; 0 takes any improvement; default
    DEFAULT_GAIN_PER_COPY_ROUND / num_ranks.
    max_search_steps: local-search moves per layer and candidate (default 4 * P).
    """
    load = check_load(load)
    num_layers, num_experts = load.shape
    layout = _layout(num_experts, num_slots, num_ranks, num_nodes, num_groups)
    if min_gain_per_move is None:
        min_gain_per_move = DEFAULT_GAIN_PER_COPY_ROUND / num_ranks
    if min_gain_per_move < 0:
        raise ValueError(f"min_gain_per_move must be >= 0, got {min_gain_per_move}")
    steps = 4 * num_slots if max_search_steps is None else max_search_steps
    if previous is not None:
        _check_previous(previous, num_layers, num_experts, num_slots, num_ranks)

    phy2log = np.empty((num_layers, num_slots), dtype=np.int64)
    before = torch.empty(num_layers, dtype=torch.float64) if previous is not None else None
    after = torch.empty(num_layers, dtype=torch.float64)
    moved = torch.zeros(num_layers, dtype=torch.long)
    for layer in range(num_layers):
        layer_load = load[layer].numpy()
        prev = None if previous is None else previous.phy2log[layer].numpy()
        choice = _rebalance_layer(layer_load, layout, prev, min_gain_per_move, steps)
        phy2log[layer] = choice.slot_expert
        after[layer] = choice.balancedness
        moved[layer] = choice.moved
        if before is not None:
            before[layer] = _balancedness(layer_load, prev, num_ranks)
    placement = Placement.from_phy2log(torch.from_numpy(phy2log), num_experts, num_ranks, num_nodes)
    placement.stats = RebalanceStats(before, after, moved)
    if previous is not None:
        logger.info(
            "rebalance: balancedness %.3f -> %.3f, %d expert weights moved",
            float(before.mean()), float(after.mean()), int(moved.sum()),
        )
    return placement


@dataclass(frozen=True)
class _Candidate:
    slot_expert: np.ndarray  # [P]
    balancedness: float
    moved: int

    def score(self, min_gain_per_move: float) -> float:
        return self.balancedness - min_gain_per_move * self.moved


def _rebalance_layer(load, layout: Layout, prev, min_gain_per_move, steps) -> _Candidate:
    packed = _fresh_layer(load, layout)
    fresh_search = LayerSearch(
        packed, load, layout.num_ranks, layout.max_replicas, _allowed_from(packed, layout)
    )
    fresh_search.run(steps)
    if prev is None:
        return _Candidate(fresh_search.slot_expert, fresh_search.balancedness(), 0)

    fresh = align_to_previous(
        fresh_search.slot_expert, prev, layout.num_experts, layout.num_ranks,
        layout.ranks_per_node if layout.hierarchical else None,
    )
    candidates = [_Candidate(fresh, fresh_search.balancedness(), int((fresh != prev).sum()))]
    allowed = _allowed_from(prev, layout)
    if allowed is not None:  # `prev` obeys this layout, so keeping or editing it is an option
        candidates.append(_Candidate(prev, _balancedness(load, prev, layout.num_ranks), 0))
        candidates.append(_improve_in_place(prev, load, layout, allowed, min_gain_per_move, steps))
        target = np.bincount(fresh_search.slot_expert, minlength=layout.num_experts)
        candidates.append(_improve_in_place(prev, load, layout, allowed, min_gain_per_move, steps, target))
    return max(candidates, key=lambda c: (c.score(min_gain_per_move), -c.moved))


def _improve_in_place(prev, load, layout, allowed, min_gain_per_move, steps, target_counts=None) -> _Candidate:
    """Local search from `prev`; returns the best-scoring point along its path.

    With `target_counts` [E], first rewrite slots until replica counts match
    them (those moves are kept whatever they score), then search.
    """
    search = LayerSearch(prev, load, layout.num_ranks, layout.max_replicas, allowed)
    if target_counts is not None:
        search.move_towards_counts(target_counts)
    best = _Candidate(search.slot_expert.copy(), search.balancedness(), int((search.slot_expert != prev).sum()))
    for _ in range(steps):
        move = search.best_move()
        if move is None:
            break
        search.apply(move)
        point = _Candidate(search.slot_expert.copy(), search.balancedness(), int((search.slot_expert != prev).sum()))
        if point.score(min_gain_per_move) > best.score(min_gain_per_move) + 1e-12:
            best = point
    return best


def _fresh_layer(load: np.ndarray, layout: Layout) -> np.ndarray:
    """[P] expert per slot: greedy replication, then balanced packing per node (or globally)."""
    slot_expert = np.empty(layout.num_slots, dtype=np.int64)
    if not layout.hierarchical:
        domains = [np.arange(layout.num_experts)]
    else:
        group_size = layout.num_experts // layout.num_groups
        group_load = load.reshape(layout.num_groups, group_size).sum(1)
        node_of_group = balanced_pack(
            group_load, np.arange(layout.num_groups), layout.num_nodes, layout.num_groups // layout.num_nodes
        )
        domains = [
            (np.flatnonzero(node_of_group == node)[:, None] * group_size + np.arange(group_size)).ravel()
            for node in range(layout.num_nodes)
        ]
    domain_ranks = layout.num_ranks // len(domains)
    domain_slots = layout.num_slots // len(domains)
    for index, experts in enumerate(domains):
        counts = greedy_replica_counts(load[experts], domain_slots, min(domain_ranks, layout.max_replicas))
        replica_expert = np.repeat(experts, counts)  # [domain_slots]
        replica_load = np.repeat(load[experts] / counts, counts)
        bins = balanced_pack(replica_load, replica_expert, domain_ranks, layout.slots_per_rank)
        order = np.lexsort((np.arange(bins.size), bins))  # items grouped by bin
        slot_expert[index * domain_slots : (index + 1) * domain_slots] = replica_expert[order]
    return slot_expert


def _allowed_from(slot_expert: np.ndarray, layout: Layout) -> Optional[np.ndarray]:
    """[E, W] bool: ranks each expert may use while its group stays on one node.

    None when `slot_expert` breaks the layout (co-located replicas, or a group
    spread over several nodes in hierarchical mode).
    """
    rank = np.arange(layout.num_slots) // layout.slots_per_rank
    pairs = slot_expert * layout.num_ranks + rank
    if np.unique(pairs).size != pairs.size:
        return None
    if not layout.hierarchical:
        return np.ones((layout.num_experts, layout.num_ranks), dtype=bool)
    node = rank // layout.ranks_per_node
    group = slot_expert // (layout.num_experts // layout.num_groups)
    node_of_group = np.full(layout.num_groups, -1)
    node_of_group[group] = node
    if (node_of_group[group] != node).any():
        return None
    node_of_expert = np.repeat(node_of_group, layout.num_experts // layout.num_groups)  # [E]
    return node_of_expert[:, None] == (np.arange(layout.num_ranks) // layout.ranks_per_node)[None, :]


def _balancedness(load: np.ndarray, slot_expert: np.ndarray, num_ranks: int) -> float:
    counts = np.bincount(slot_expert, minlength=load.shape[0])
    rank = np.arange(slot_expert.size) // (slot_expert.size // num_ranks)
    per_rank = np.bincount(rank, weights=(load / np.maximum(counts, 1))[slot_expert], minlength=num_ranks)
    peak = per_rank.max()
    return 1.0 if peak <= 0 else float(per_rank.mean() / peak)


def _layout(num_experts, num_slots, num_ranks, num_nodes, num_groups) -> Layout:
    check_layout(num_experts, num_slots, num_ranks, num_nodes)
    if num_groups is None or num_nodes == 1:
        return Layout(num_experts, num_slots, num_ranks, num_nodes, None)
    if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups!r}) must be a positive divisor of num_experts ({num_experts})")
    ranks_per_node = num_ranks // num_nodes
    if num_groups % num_nodes:
        logger.warning(
            "rebalance: num_groups (%d) is not divisible by num_nodes (%d); groups cannot be "
            "kept within nodes, using global placement", num_groups, num_nodes,
        )
        return Layout(num_experts, num_slots, num_ranks, num_nodes, None)
    if num_slots // num_nodes > (num_experts // num_nodes) * ranks_per_node:
        logger.warning(
            "rebalance: %d slots per node exceed %d experts per node x %d ranks per node; "
            "using global placement", num_slots // num_nodes, num_experts // num_nodes, ranks_per_node,
        )
        return Layout(num_experts, num_slots, num_ranks, num_nodes, None)
    return Layout(num_experts, num_slots, num_ranks, num_nodes, num_groups)


def _check_previous(previous: Placement, num_layers, num_experts, num_slots, num_ranks) -> None:
    if not isinstance(previous, Placement):
        raise TypeError(f"previous must be a Placement, got {type(previous).__name__}")
    expected = (num_layers, num_slots)
    if tuple(previous.phy2log.shape) != expected:
        raise ValueError(f"previous.phy2log has shape {tuple(previous.phy2log.shape)}, load needs {expected}")
    if previous.num_experts != num_experts or previous.num_ranks != num_ranks:
        raise ValueError(
            f"previous placement is for {previous.num_experts} experts on {previous.num_ranks} ranks, "
            f"load needs {num_experts} experts on {num_ranks} ranks"
        )
