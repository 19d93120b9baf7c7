"""Replicate hot experts and pack slots onto ranks so per-rank load is even.

Per layer, a fresh placement is built first, the better of two, each followed
by local search (which never raises the peak rank's risk; at load_noise 0,
never lowers balancedness):
- greedy replication capped at one replica per rank, then balanced packing
  that never puts two replicas of an expert on one rank;
- DeepSeek EPLB's own plan (`eplb_plan`), with replicas that share a rank
  repaired away (`colocation_repair`). When EPLB's plan is valid it is kept
  as is, so at load_noise 0 the fresh placement (and the result without a
  previous placement, or with min_gain_per_move 0) is never less balanced
  than EPLB's; when EPLB
  co-locates replicas, that plan splits an expert unevenly, which no valid
  placement can express, and may beat every valid placement.
When a placement is already in force, three candidates compete:
- keep it or improve it in place with local search, stopping at the point of
  the search path (its start included) where
  balancedness - min_gain_per_move * experts moved is best;
- the same, after first rewriting just enough slots to adopt the fresh
  placement's replica counts;
- the fresh placement, relabelled (ranks permuted, slots reordered) to overlap
  the placement in force.
The winner maximises balancedness - min_gain_per_move * experts moved (with
load_noise > 0, a risk-adjusted balancedness), so an expert is moved only when
it buys at least `min_gain_per_move` balancedness.
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

from moe_runtime.load_balancer.alignment import align_to_previous
from moe_runtime.load_balancer.balancedness import check_load
from moe_runtime.load_balancer.colocation_repair import repair_colocation
from moe_runtime.load_balancer.eplb_plan import eplb_plan
from moe_runtime.load_balancer.layout import Layout
from moe_runtime.load_balancer.local_search import LayerSearch
from moe_runtime.load_balancer.packing import balanced_pack
from moe_runtime.load_balancer.placement import Placement, RebalanceStats, check_layout
from moe_runtime.load_balancer.replication import greedy_replica_counts
from moe_runtime.load_balancer.slot_geometry import SlotGeometry

logger = logging.getLogger(__name__)

DEFAULT_GAIN_PER_COPY_ROUND = 0.001
DEFAULT_LOAD_NOISE = 0.0


def rebalance(
    load: torch.Tensor,  # [L, E] recent tokens per logical expert
    num_slots: int,
    num_ranks: int,
    num_nodes: int = 1,
    previous: Optional[Placement] = None,
    *,
    num_groups: Optional[int] = None,
    min_gain_per_move: Optional[float] = None,
    load_noise: float = DEFAULT_LOAD_NOISE,
    max_search_steps: Optional[int] = None,
) -> Placement:
    """New placement for `load`; with `previous`, moves only experts that pay.

    min_gain_per_move: balancedness (mean/max per-rank load, per layer) an
    expert move must buy; 0 takes any improvement; default
    DEFAULT_GAIN_PER_COPY_ROUND / num_ranks.
    load_noise: expected relative change of each expert's load before the next
    rebalance; placements are scored on rank load + load_noise x its standard
    deviation under such changes (0: fit `load` exactly, however fragile).
    max_search_steps: local-search moves per layer and candidate (default 4 * P).
    """
    load = check_load(load)
    num_layers, num_experts = load.shape
    layout = _layout(num_experts, num_slots, num_ranks, num_nodes, num_groups)
    if min_gain_per_move is None:
        min_gain_per_move = DEFAULT_GAIN_PER_COPY_ROUND / num_ranks
    if min_gain_per_move < 0:
        raise ValueError(f"min_gain_per_move must be >= 0, got {min_gain_per_move}")
    if load_noise < 0:
        raise ValueError(f"load_noise must be >= 0, got {load_noise}")
    steps = 4 * num_slots if max_search_steps is None else max_search_steps
    if previous is not None:
        _check_previous(previous, num_layers, num_experts, num_slots, num_ranks)

    phy2log = np.empty((num_layers, num_slots), dtype=np.int64)
    before = torch.empty(num_layers, dtype=torch.float64) if previous is not None else None
    after = torch.empty(num_layers, dtype=torch.float64)
    moved = torch.zeros(num_layers, dtype=torch.long)
    for layer in range(num_layers):
        layer_load = load[layer].numpy()
        prev = None if previous is None else previous.phy2log[layer].cpu().numpy()
        choice = _rebalance_layer(layer_load, layout, prev, _Scoring(min_gain_per_move, load_noise, steps))
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
class _Scoring:
    min_gain_per_move: float
    load_noise: float
    steps: int


@dataclass(frozen=True)
class _Candidate:
    slot_expert: np.ndarray  # [P]
    balancedness: float  # mean / max rank load on the given load
    risk_balancedness: float  # mean / max rank risk: what candidates compete on
    moved: int

    @classmethod
    def of(cls, search: LayerSearch, prev: Optional[np.ndarray]) -> "_Candidate":
        moved = 0 if prev is None else int((search.slot_expert != prev).sum())
        return cls(search.slot_expert.copy(), search.balancedness(), search.risk_balancedness(), moved)

    def score(self, scoring: _Scoring) -> float:
        return self.risk_balancedness - scoring.min_gain_per_move * self.moved


def _rebalance_layer(load, layout: Layout, prev, scoring: _Scoring) -> _Candidate:
    starts = (_fresh_layer(load, layout), _eplb_layer(load, layout))
    fresh = max((_searched(start, load, layout, scoring) for start in starts), key=lambda c: c.score(scoring))
    if prev is None:
        return fresh

    aligned = align_to_previous(
        fresh.slot_expert, prev, layout.num_experts, layout.num_ranks,
        layout.ranks_per_node if layout.hierarchical else None,
    )  # a relabelling of ranks and slots: balancedness unchanged
    candidates = [_Candidate(aligned, fresh.balancedness, fresh.risk_balancedness, int((aligned != prev).sum()))]
    allowed = _allowed_from(prev, layout)
    if allowed is not None:  # `prev` obeys this layout, so keeping or editing it is an option
        candidates.append(_improve_in_place(prev, load, layout, allowed, scoring))
        target = np.bincount(fresh.slot_expert, minlength=layout.num_experts)
        candidates.append(_improve_in_place(prev, load, layout, allowed, scoring, target))
    return max(candidates, key=lambda c: (c.score(scoring), -c.moved))


def _searched(packed: np.ndarray, load, layout: Layout, scoring: _Scoring) -> _Candidate:
    """Local search from a fresh [P] placement that obeys `layout`."""
    search = _search(packed, load, layout, _allowed_from(packed, layout), scoring)
    search.run(scoring.steps)
    return _Candidate.of(search, None)


def _eplb_layer(load: np.ndarray, layout: Layout) -> np.ndarray:
    """[P] EPLB's own placement, with replicas that share a rank repaired away."""
    plan = eplb_plan(load, layout)
    node_of_expert = np.repeat(plan.node_of_group, layout.group_size)  # [E]
    node_of_rank = np.arange(layout.num_ranks) // (layout.ranks_per_node if layout.hierarchical else layout.num_ranks)
    allowed = node_of_expert[:, None] == node_of_rank[None, :]  # [E, W]
    return repair_colocation(plan.slot_expert, load, layout.num_ranks, allowed)


def _search(slot_expert, load, layout: Layout, allowed, scoring: _Scoring) -> LayerSearch:
    return LayerSearch(slot_expert, load, layout.num_ranks, layout.max_replicas, allowed, scoring.load_noise)


def _improve_in_place(prev, load, layout, allowed, scoring: _Scoring, target_counts=None) -> _Candidate:
    """Local search from `prev`; returns the best-scoring point along its path.

    With `target_counts` [E], first rewrite slots until replica counts match
    them (those moves are kept whatever they score), then search.
    """
    search = _search(prev, load, layout, allowed, scoring)
    if target_counts is not None:
        search.move_towards_counts(target_counts)
    best = _Candidate.of(search, prev)
    for _ in range(scoring.steps):
        move = search.best_move()
        if move is None:
            break
        search.apply(move)
        point = _Candidate.of(search, prev)
        if point.score(scoring) > best.score(scoring) + 1e-12:
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
    rank = layout.geometry.slot_ranks()  # [P]
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
    rank = SlotGeometry(slot_expert.size, num_ranks).slot_ranks()  # [P]
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
