"""Rebalancing while serving: plan from the recorded window, move weights in chunks, switch at once.

Runs inside every worker rank's lock-step loop, so every rank starts, advances and commits a
rebalance at the same step boundary:
- start: the window's counts are summed over all ranks; rank 0 plans (`rebalance`, migration-aware)
  and broadcasts the new placement, so every rank holds the same plan;
- advance: each step moves the weights of `layers_per_step` MoE layers (point-to-point, staged),
  so no step stalls for the whole model;
- commit: the ranks agree (one all-reduce) that every copy arrived; then all swap weights and the
  placement together. If any rank failed, every rank drops its staged copies and the old
  placement stays in force; the failure is logged and reported as an event.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from load_balancer.balancedness import balancedness
from load_balancer.migration import plan_migration
from load_balancer.placement import Placement
from load_balancer.rebalance import rebalance
from load_balancer.weight_migration import commit_staged, migrate_layer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalancePolicy:
    interval_steps: int = 0          # rebalance every N lock-step steps (0 = off)
    threshold: float = 0.0           # ... or when mean balancedness over layers drops below this (0 = off)
    check_every: int = 32            # steps between threshold checks (each costs one all-reduce)
    layers_per_step: int = 0         # MoE layers migrated per step (0 = all in one step)
    num_nodes: int = 1


@dataclass
class RebalanceOutcome:
    """What one rebalance did; rank 0 turns it into the engine's RebalanceEvent."""

    trigger: str
    started_at: float
    duration_s: float
    experts_moved: int
    balancedness_before: float
    balancedness_after: float
    ok: bool
    error: str | None = None


class _Migration:
    def __init__(self, trigger, previous, new, plan, layers, started, before, after, fail_on_rank):
        self.trigger, self.previous, self.new, self.plan = trigger, previous, new, plan
        self.layers_left = layers
        self.started, self.before, self.after = started, before, after
        self.fail_on_rank = fail_on_rank
        self.staged: dict[int, list] = {}
        self.error: str | None = None


class LiveRebalancer:
    def __init__(self, executor, policy: RebalancePolicy, group=None):
        self.executor = executor          # ExpertParallelExecutor: placement, recorder, experts_by_layer
        self.policy = policy
        self.group = group
        self.rank = dist.get_rank(group)
        self._migration: _Migration | None = None
        self.count = 0

    @property
    def in_progress(self) -> bool:
        return self._migration is not None

    def after_step(self, step: int) -> RebalanceOutcome | None:
        """Called by every rank after every lock-step step."""
        if self._migration is None:
            trigger = self._due(step)
            if trigger is not None:
                self.start(trigger)
        if self._migration is not None:
            return self.advance()
        return None

    def _due(self, step: int) -> str | None:
        p = self.policy
        if p.interval_steps and step % p.interval_steps == 0:
            return "interval"
        if p.threshold and step % p.check_every == 0:
            snapshot = self.executor.recorder.snapshot(group=self.group)
            if snapshot.counts.sum() > 0 and float(snapshot.balancedness.mean()) < p.threshold:
                return "threshold"
        return None

    def start(self, trigger: str, fail_on_rank: int | None = None) -> None:
        """Plan a rebalance from the recorded window (all ranks call this at the same step)."""
        if self._migration is not None:
            return
        started = time.time()
        previous: Placement = self.executor.placement
        load = self.executor.recorder.snapshot(group=self.group).counts.float()  # [L, E], summed over ranks
        phy2log = previous.phy2log.clone()
        if self.rank == 0:
            phy2log = rebalance(load, previous.num_slots, previous.num_ranks, self.policy.num_nodes,
                                previous=previous).phy2log.clone()
        dist.broadcast(phy2log, src=0, group=self.group)
        new = Placement.from_phy2log(phy2log, previous.num_experts, previous.num_ranks, self.policy.num_nodes)
        plan = plan_migration(previous, new)
        layers = sorted(set(plan.layer.tolist()))
        before = float(balancedness(load, previous).mean()) if load.sum() > 0 else 1.0
        after = float(balancedness(load, new).mean()) if load.sum() > 0 else 1.0
        self._migration = _Migration(trigger, previous, new, plan, layers, started, before, after, fail_on_rank)
        logger.info("rebalance (%s) planned: %d expert weights to move, balancedness %.3f -> %.3f",
                    trigger, plan.num_moved, before, after)

    def advance(self) -> RebalanceOutcome | None:
        """Move the next chunk of layers. Ranks first agree that all are ready for it (a rank that
        cannot take part must not leave its peers waiting on a transfer that never comes)."""
        m = self._migration
        chunk = self.policy.layers_per_step or len(m.layers_left)
        todo, m.layers_left = m.layers_left[:chunk], m.layers_left[chunk:]
        try:
            if m.fail_on_rank == self.rank:
                raise RuntimeError(f"injected migration failure on rank {self.rank}")
            missing = [layer for layer in todo if layer not in self.executor.experts_by_layer]
            if missing:
                raise KeyError(f"no experts registered for MoE layers {missing}")
        except Exception as exc:
            m.error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            logger.error("expert migration cannot proceed: %s", m.error)
        if not self._all_ranks_ok(m.error is None):
            m.error = m.error or "another rank could not take part in the migration"
            return self._finish(committed=False)
        for moe_layer in todo:
            experts = self.executor.experts_by_layer[moe_layer]
            m.staged[moe_layer] = migrate_layer(m.plan, m.previous, moe_layer, experts, self.rank, self.group)
        if m.layers_left:
            return None
        return self._finish(committed=True)

    def _all_ranks_ok(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _finish(self, committed: bool) -> RebalanceOutcome:
        m = self._migration
        self._migration = None
        if committed:
            for moe_layer, staged in m.staged.items():
                commit_staged(self.executor.experts_by_layer[moe_layer], staged)
            self.executor.set_placement(m.new)
            logger.info("rebalance (%s) committed: %d expert weights moved in %.3fs", m.trigger, m.plan.num_moved,
                        time.time() - m.started)
        else:
            logger.error("rebalance (%s) rolled back, the previous placement stays in force: %s", m.trigger, m.error)
        self.count += 1
        return RebalanceOutcome(m.trigger, m.started, time.time() - m.started,
                                m.plan.num_moved if committed else 0, m.before,
                                m.after if committed else m.before, committed, None if committed else m.error)
