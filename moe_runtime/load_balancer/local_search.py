"""Local search that lowers the heaviest rank of one layer, one slot at a time.

Two moves, both keeping every rank at `slots_per_rank` slots and every expert's
replicas on distinct ranks:
- swap: exchange the experts of a slot on the heaviest rank and a slot elsewhere;
- retarget: rewrite one slot from an expert with >= 2 replicas to another expert
  (changes replica counts, so the per-replica load of both experts).
The objective is a rank's *risk*: its load plus `load_noise` times the standard
deviation its load would have if every expert's load moved by a relative
`load_noise` independently (sqrt of the sum of squared per-replica loads). With
load_noise 0 this is plain per-rank load; above 0 it prefers placements whose
peak ranks are not made of one big replica that a small shift in load would
overflow, which keeps balance better on the load that actually comes next.
Only moves that touch the riskiest rank (a slot on it, or a replica of an expert
it holds) are considered: no other move can lower the maximum. A move is taken
when it lowers the maximum risk, or keeps it and lowers the sum of squared
risks (which walks off plateaus where several ranks tie for the maximum).
(max, sum of squares) strictly decreases, so the search cannot cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from moe_runtime.load_balancer.slot_geometry import SlotGeometry


@dataclass(frozen=True)
class Move:
    slot: int  # slot rewritten (retarget) or first slot of a swap (on the heaviest rank)
    expert: int  # expert written into `slot`
    other_slot: int = -1  # swap partner, -1 for a retarget


class LayerSearch:
    """Mutable placement of one layer plus the bookkeeping the moves need."""

    def __init__(
        self,
        slot_expert: np.ndarray,  # [P] int64
        load: np.ndarray,  # [E] float64
        num_ranks: int,
        max_replicas: int,
        allowed: Optional[np.ndarray] = None,  # [E, W] bool: expert may live on rank
        load_noise: float = 0.0,
    ):
        self.load_noise = load_noise
        self.slot_expert = slot_expert.astype(np.int64).copy()
        self.load = load.astype(np.float64)
        self.num_experts = load.shape[0]
        self.num_slots = slot_expert.shape[0]
        self.num_ranks = num_ranks
        self.geometry = SlotGeometry(self.num_slots, num_ranks)
        self.max_replicas = max_replicas
        self.allowed = np.ones((self.num_experts, num_ranks), bool) if allowed is None else allowed
        self.slot_rank = self.geometry.slot_ranks()  # [P]
        self.count = np.bincount(self.slot_expert, minlength=self.num_experts)  # [E]
        self.hold = np.zeros((self.num_experts, num_ranks), dtype=bool)  # [E, W]
        self.hold[self.slot_expert, self.slot_rank] = True
        if self.hold.sum() != self.num_slots:
            raise ValueError("LayerSearch needs a placement without co-located replicas")
        self._refresh()

    def _refresh(self) -> None:
        self.per_replica = self.load / self.count  # [E]
        per_slot = self.per_replica[self.slot_expert]  # [P]
        self.rank_load = np.bincount(self.slot_rank, weights=per_slot, minlength=self.num_ranks)  # [W]
        self.rank_square = np.bincount(self.slot_rank, weights=per_slot**2, minlength=self.num_ranks)  # [W]
        self.rank_risk = self._risk(self.rank_load, self.rank_square)  # [W]

    def _risk(self, load: np.ndarray, square: np.ndarray) -> np.ndarray:
        if self.load_noise == 0:
            return load
        return load + self.load_noise * np.sqrt(np.maximum(square, 0.0))

    def balancedness(self) -> float:
        """mean / max per-rank load (1.0 = perfect)."""
        peak = self.rank_load.max()
        return 1.0 if peak <= 0 else float(self.rank_load.mean() / peak)

    def risk_balancedness(self) -> float:
        """mean load / max risk: what the search maximises (= balancedness at load_noise 0)."""
        peak = self.rank_risk.max()
        return 1.0 if peak <= 0 else float(self.rank_load.mean() / peak)

    def run(self, max_steps: int) -> int:
        """Apply improving moves until none is left; returns the number applied."""
        for step in range(max_steps):
            move = self.best_move()
            if move is None:
                return step
            self.apply(move)
        return max_steps

    def apply(self, move: Move) -> None:
        slot, new = move.slot, move.expert
        old = int(self.slot_expert[slot])
        rank = int(self.slot_rank[slot])
        if move.other_slot >= 0:
            other_rank = int(self.slot_rank[move.other_slot])
            self.slot_expert[move.other_slot] = old
            self.hold[new, other_rank] = False
            self.hold[old, other_rank] = True
        else:
            self.count[old] -= 1
            self.count[new] += 1
        self.slot_expert[slot] = new
        self.hold[old, rank] = False
        self.hold[new, rank] = True
        self._refresh()

    def best_move(self) -> Optional[Move]:
        risks = self.rank_risk
        peak_rank = int(np.argmax(risks))
        peak = risks[peak_rank]
        if peak <= 0:
            return None
        sumsq = float((risks**2).sum())
        candidates = [self._swap_candidates(peak_rank), self._retarget_candidates(peak_rank)]
        best: Optional[tuple] = None
        for new_max, new_sumsq, moves in candidates:
            if new_max.size == 0:
                continue
            lowers_max = new_max < peak * (1 - 1e-12)
            flattens = (new_max <= peak) & (new_sumsq < sumsq * (1 - 1e-12))
            good = lowers_max | flattens
            if not good.any():
                continue
            # Prefer lowering the maximum; among those, the lowest maximum, then flattest.
            order = np.lexsort((new_sumsq, new_max, ~lowers_max))
            pick = order[0]
            key = (not lowers_max[pick], float(new_max[pick]), float(new_sumsq[pick]))
            if best is None or key < best[0]:
                best = (key, moves(pick))
        return None if best is None else best[1]

    def _swap_candidates(self, peak_rank: int):
        peak_slots = np.array(self.geometry.rank_slots(peak_rank))  # [S]
        other_slots = np.flatnonzero(self.slot_rank != peak_rank)  # [P - S]
        a = self.slot_expert[peak_slots][:, None]  # [S, 1]
        b = self.slot_expert[other_slots][None, :]  # [1, P-S]
        other_rank = self.slot_rank[other_slots][None, :]  # [1, P-S]
        w = self.per_replica
        valid = (
            (w[a] > w[b])
            & ~self.hold[b, peak_rank]
            & ~self.hold[a, other_rank]
            & self.allowed[b, peak_rank]
            & self.allowed[a, other_rank]
        )  # [S, P-S]
        loads, squares, risks = self.rank_load, self.rank_square, self.rank_risk
        new_peak = self._risk(loads[peak_rank] - w[a] + w[b], squares[peak_rank] - w[a] ** 2 + w[b] ** 2)
        new_other = self._risk(loads[other_rank] - w[b] + w[a], squares[other_rank] - w[b] ** 2 + w[a] ** 2)
        # Max over ranks untouched by the swap: skip the peak rank and the partner rank.
        ranked = np.argsort(-risks, kind="stable")
        rest = ranked[ranked != peak_rank]
        first, second = risks[rest[0]], (risks[rest[1]] if rest.size > 1 else 0.0)
        untouched = np.where(other_rank == rest[0], second, first)
        new_max = np.maximum(np.maximum(new_peak, new_other), untouched)
        sumsq = (risks**2).sum()
        new_sumsq = sumsq - risks[peak_rank] ** 2 - risks[other_rank] ** 2 + new_peak**2 + new_other**2
        rows, cols = np.nonzero(valid)
        return (
            new_max[rows, cols],
            new_sumsq[rows, cols],
            lambda k: Move(int(peak_slots[rows[k]]), int(b[0, cols[k]]), int(other_slots[cols[k]])),
        )

    def _retarget_candidates(self, peak_rank: int):
        size = self.geometry.slots_per_rank
        peak_slots = np.array(self.geometry.rank_slots(peak_rank))  # [S]
        peak_experts = self.slot_expert[peak_slots]
        # Rewrite a slot of the peak rank to any expert, or any slot to an expert of the peak rank.
        slot = np.concatenate(
            [np.repeat(peak_slots, self.num_experts), np.repeat(np.arange(self.num_slots), size)]
        )
        new = np.concatenate(
            [np.tile(np.arange(self.num_experts), size), np.tile(peak_experts, self.num_slots)]
        )
        return self.evaluate_retargets(slot, new)

    def evaluate_retargets(self, slot: np.ndarray, new: np.ndarray):
        """(new max, new sum of squares, Move factory) for the valid (slot -> new expert) rewrites."""
        old = self.slot_expert[slot]
        rank = self.slot_rank[slot]
        count = self.count
        valid = (
            (old != new)
            & (count[old] >= 2)
            & (count[new] < self.max_replicas)
            & ~self.hold[new, rank]
            & self.allowed[new, rank]
        )
        slot, new, old, rank = slot[valid], new[valid], old[valid], rank[valid]
        if slot.size == 0:
            empty = np.empty(0)
            return empty, empty, None
        load, w = self.load, self.per_replica
        old_after = load[old] / (count[old] - 1)  # per-replica load once a replica is gone
        new_after = load[new] / (count[new] + 1)
        delta = (
            self.hold[old] * (old_after - w[old])[:, None]
            + self.hold[new] * (new_after - w[new])[:, None]
        )  # [C, W]
        delta[np.arange(slot.size), rank] += new_after - old_after
        after = self.rank_load[None, :] + delta
        if self.load_noise:
            square_delta = (
                self.hold[old] * (old_after**2 - w[old] ** 2)[:, None]
                + self.hold[new] * (new_after**2 - w[new] ** 2)[:, None]
            )  # [C, W]
            square_delta[np.arange(slot.size), rank] += new_after**2 - old_after**2
            after = self._risk(after, self.rank_square[None, :] + square_delta)
        return (
            after.max(1),
            (after**2).sum(1),
            lambda k: Move(int(slot[k]), int(new[k])),
        )

    def move_towards_counts(self, target: np.ndarray) -> int:
        """Retarget slots from over- to under-replicated experts (vs `target` [E]).

        Each step takes the rewrite with the lowest resulting peak. Stops when
        counts match or no allowed rewrite is left; returns the rewrites made.
        """
        done = 0
        while True:
            surplus = np.flatnonzero(self.count > target)
            deficit = np.flatnonzero(self.count < target)
            if surplus.size == 0 or deficit.size == 0:
                return done
            slot = np.flatnonzero(np.isin(self.slot_expert, surplus))
            new_max, new_sumsq, moves = self.evaluate_retargets(
                np.repeat(slot, deficit.size), np.tile(deficit, slot.size)
            )
            if new_max.size == 0:
                return done
            self.apply(moves(int(np.lexsort((new_sumsq, new_max))[0])))
            done += 1
