"""Make a placement valid by removing replicas that share a rank with their expert.

A rank holding k replicas of expert e serves k / count of e's tokens; valid
placements split an expert's tokens evenly over distinct ranks. Each step fixes
one surplus replica (a replica of e on a rank already holding e) with the
cheapest of:
- swap: exchange it with a slot on another rank that does not hold e, whose
  expert the first rank does not hold;
- retarget: rewrite it to an expert its rank does not hold (e loses a replica,
  that expert gains one).
"Cheapest" = lowest resulting maximum rank load, then lowest sum of squared
rank loads, under the runtime's even split over all replicas (co-located ones
included, as the runtime counts them). A retarget always exists (a rank with a
surplus replica holds fewer distinct experts than it has slots), so the loop
ends after at most one step per surplus replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_runtime.load_balancer.slot_geometry import SlotGeometry


@dataclass(frozen=True)
class _Fix:
    peak: float  # max rank load after the fix
    spread: float  # sum of squared rank loads after the fix
    slot: int
    expert: int  # written into `slot`
    other_slot: int = -1  # swap partner, -1 for a retarget


def repair_colocation(
    slot_expert: np.ndarray,  # [P] may hold co-located replicas
    load: np.ndarray,  # [E]
    num_ranks: int,
    allowed: np.ndarray,  # [E, W] bool: expert may live on rank
) -> np.ndarray:
    """[P] placement without co-located replicas."""
    slot_expert = slot_expert.astype(np.int64).copy()
    while True:
        surplus = _surplus_slots(slot_expert, load.shape[0], num_ranks)
        if surplus.size == 0:
            return slot_expert
        fixes = [_best_fix(slot_expert, load, num_ranks, allowed, int(slot)) for slot in surplus]
        fix = min((f for f in fixes if f is not None), key=lambda f: (f.peak, f.spread, f.slot))
        if fix.other_slot >= 0:
            slot_expert[fix.other_slot] = slot_expert[fix.slot]
        slot_expert[fix.slot] = fix.expert


def _surplus_slots(slot_expert: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Slots holding an expert that an earlier slot of the same rank already holds."""
    rank = SlotGeometry(slot_expert.size, num_ranks).slot_ranks()  # [P]
    pair = slot_expert * num_ranks + rank  # [P]
    _, first = np.unique(pair, return_index=True)
    surplus = np.ones(slot_expert.size, dtype=bool)
    surplus[first] = False
    return np.flatnonzero(surplus)


def _best_fix(slot_expert, load, num_ranks, allowed, slot) -> _Fix | None:
    num_experts, num_slots = load.shape[0], slot_expert.size
    slot_rank = SlotGeometry(num_slots, num_ranks).slot_ranks()  # [P]
    held = np.zeros((num_experts, num_ranks), dtype=np.int64)  # [E, W] replicas per rank
    np.add.at(held, (slot_expert, slot_rank), 1)
    count = held.sum(1)  # [E]
    per_replica = load / np.maximum(count, 1)  # [E]
    rank_load = np.bincount(slot_rank, weights=per_replica[slot_expert], minlength=num_ranks)  # [W]
    expert, rank = int(slot_expert[slot]), int(slot_rank[slot])
    options = []

    # swap with slot s' (rank r', expert g): rank gains w_g - w_e, r' gains w_e - w_g
    partner = np.flatnonzero(
        (slot_rank != rank)
        & (held[expert, slot_rank] == 0)
        & (held[slot_expert, rank] == 0)
        & allowed[expert, slot_rank]
        & allowed[slot_expert, rank]
    )
    if partner.size:
        shift = per_replica[slot_expert[partner]] - per_replica[expert]  # [C]
        after = np.repeat(rank_load[None, :], partner.size, 0)  # [C, W]
        after[:, rank] += shift
        after[np.arange(partner.size), slot_rank[partner]] -= shift
        pick = int(np.lexsort(((after**2).sum(1), after.max(1)))[0])
        options.append(_Fix(float(after[pick].max()), float((after[pick] ** 2).sum()), slot,
                            int(slot_expert[partner[pick]]), int(partner[pick])))

    # retarget to expert f absent from this rank: e and f change per-replica load everywhere
    target = np.flatnonzero((held[:, rank] == 0) & allowed[:, rank])
    if target.size:
        expert_after = load[expert] / (count[expert] - 1)
        target_after = load[target] / (count[target] + 1)  # [C]
        after = (
            rank_load[None, :]
            + held[expert][None, :] * (expert_after - per_replica[expert])
            + held[target] * (target_after - per_replica[target])[:, None]
        )  # [C, W]
        after[:, rank] += target_after - expert_after
        pick = int(np.lexsort(((after**2).sum(1), after.max(1)))[0])
        options.append(_Fix(float(after[pick].max()), float((after[pick] ** 2).sum()), slot, int(target[pick])))
    return min(options, key=lambda f: (f.peak, f.spread)) if options else None
