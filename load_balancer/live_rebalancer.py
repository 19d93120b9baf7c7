"""Rebalancing while serving: plan from the recorded window, move weights in chunks, switch at once.

Runs inside every worker rank's lock-step loop, so every rank starts, advances and commits a
rebalance at the same step boundary. Each pipeline stage balances its own MoE layers over its EP
group; all stages rebalance together:
- start: the window's counts are summed over the stage's EP group; the stage's first rank plans
  (`rebalance`, migration-aware) and broadcasts the new placement, so every rank of the stage holds
  the same plan. All ranks of the job agree on how many steps the migration takes (the stage with
  the most layers to move sets it), so every stage finishes at the same step;
- advance: each step moves the weights of `layers_per_step` MoE layers (point-to-point within the
  EP group, staged), so no step stalls for the whole model;
- commit: all ranks of the job agree (one all-reduce) that every copy arrived; then all swap
  weights and placement together. If any rank failed, every rank drops its staged copies and the
  old placement stays in force on every stage; the failure is logged and reported as an event.

Agreement flags and the plan travel over the gloo control groups (CPU tensors); expert weights and
load counts over the EP data group. The outcome is merged over the stages (experts moved summed,
balancedness averaged weighted by each stage's MoE layer count), so global rank 0 reports one
outcome per rebalance.
"""
from __future__ import annotations

import dataclasses
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
    """What one rebalance did over the whole job; global rank 0 turns it into the engine's RebalanceEvent."""

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
        self.steps_left = 1
        self.staged: dict[int, list] = {}
        self.error: str | None = None


class LiveRebalancer:
    """One rank's part in live rebalancing. `group` is the EP data group (default: the executor's);
    the control groups come from the executor's ParallelContext."""

    def __init__(self, executor, policy: RebalancePolicy, group=None):
        parallel = executor.parallel
        self.executor = executor          # ExpertParallelExecutor: placement, recorder, experts_by_layer
        self.policy = policy
        self.group = parallel.ep_group if group is None else group
        self.stage_control = parallel.ep_control_group     # the plan broadcast
        self.job_control = parallel.world_control_group    # trigger, step count and success: every stage
        self.stage_peers = parallel.pp_control_group       # one rank per stage: merging the outcome
        self.num_stages = parallel.pp_size
        self.rank = dist.get_rank(self.group)              # EP rank: the placement's and the plan's ranks
        self.global_rank = parallel.rank
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
            low = bool(snapshot.counts.sum() > 0) and float(snapshot.balancedness.mean()) < p.threshold
            if self._agree(int(low), dist.ReduceOp.MAX):  # one stage out of balance: all stages rebalance
                return "threshold"
        return None

    def start(self, trigger: str, fail_on_rank: int | None = None) -> None:
        """Plan a rebalance from the recorded window (all ranks call this at the same step).
        `fail_on_rank` (a global rank) injects a failure there, for tests."""
        if self._migration is not None:
            return
        started = time.time()
        previous: Placement = self.executor.placement
        load = self.executor.recorder.snapshot(group=self.group).counts.float()  # [L, E], summed over the stage
        phy2log = previous.phy2log.clone().cpu()
        if self.rank == 0:
            phy2log = rebalance(load, previous.num_slots, previous.num_ranks, self.policy.num_nodes,
                                previous=previous).phy2log.clone().cpu()
        dist.broadcast(phy2log, group=self.stage_control, group_src=0)
        new = Placement.from_phy2log(phy2log, previous.num_experts, previous.num_ranks, self.policy.num_nodes)
        plan = plan_migration(previous, new)
        layers = sorted(set(plan.layer.tolist()))
        before = float(balancedness(load, previous).mean()) if load.sum() > 0 else 1.0
        after = float(balancedness(load, new).mean()) if load.sum() > 0 else 1.0
        self._migration = _Migration(trigger, previous, new, plan, layers, started, before, after, fail_on_rank)
        self._migration.steps_left = self._agree(self._steps_for(len(layers)), dist.ReduceOp.MAX)
        logger.info("rebalance (%s) planned: %d expert weights to move, balancedness %.3f -> %.3f",
                    trigger, plan.num_moved, before, after)

    def _steps_for(self, num_layers: int) -> int:
        per_step = self.policy.layers_per_step
        return max(1, -(-num_layers // per_step)) if per_step else 1

    def advance(self) -> RebalanceOutcome | None:
        """Move the next chunk of layers. Ranks first agree that all are ready for it (a rank that
        cannot take part must not leave its peers waiting on a transfer that never comes)."""
        m = self._migration
        chunk = self.policy.layers_per_step or len(m.layers_left)
        todo, m.layers_left = m.layers_left[:chunk], m.layers_left[chunk:]  # empty once this stage is done
        m.steps_left -= 1
        try:
            if m.fail_on_rank == self.global_rank:
                raise RuntimeError(f"injected migration failure on rank {self.global_rank}")
            missing = [layer for layer in todo if layer not in self.executor.experts_by_layer]
            if missing:
                raise KeyError(f"no experts registered for MoE layers {missing}")
        except Exception as exc:
            m.error = f"rank {self.global_rank}: {type(exc).__name__}: {exc}"
            logger.error("expert migration cannot proceed: %s", m.error)
        if not self._agree(int(m.error is None), dist.ReduceOp.MIN):
            return self._finish(committed=False)
        for moe_layer in todo:
            experts = self.executor.experts_by_layer[moe_layer]
            m.staged[moe_layer] = migrate_layer(m.plan, m.previous, moe_layer, experts, self.rank, self.group)
        if m.steps_left > 0:
            return None
        return self._finish(committed=True)

    def _agree(self, value: int, op) -> int:
        """`value` reduced over every rank of the job (the world's gloo control group)."""
        flag = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(flag, op=op, group=self.job_control)
        return int(flag.item())

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
            m.error = self._first_error(m.error)
            logger.error("rebalance (%s) rolled back, the previous placement stays in force: %s", m.trigger, m.error)
        self.count += 1
        stage = RebalanceOutcome(m.trigger, m.started, time.time() - m.started,
                                 m.plan.num_moved if committed else 0, m.before,
                                 m.after if committed else m.before, committed, None if committed else m.error)
        return self._merge_stages(stage, m.previous.num_layers)

    def _first_error(self, own: str | None) -> str:
        """The failing rank's own message, on every rank (they only know that some rank failed)."""
        errors: list[str | None] = [None] * dist.get_world_size(self.job_control)
        dist.all_gather_object(errors, own, group=self.job_control)
        return next((e for e in errors if e is not None), "another rank could not take part in the migration")

    def _merge_stages(self, stage: RebalanceOutcome, num_layers: int) -> RebalanceOutcome:
        """The job's outcome from the stages' (ok and error are the same on all: they agreed)."""
        if self.num_stages == 1:
            return stage
        totals = torch.tensor([stage.experts_moved, stage.balancedness_before * num_layers,
                               stage.balancedness_after * num_layers, num_layers], dtype=torch.float64)
        dist.all_reduce(totals, group=self.stage_peers)
        moved, before, after, layers = totals.tolist()
        longest = torch.tensor([stage.duration_s], dtype=torch.float64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.stage_peers)
        return dataclasses.replace(stage, experts_moved=int(moved), duration_s=float(longest.item()),
                                   balancedness_before=before / layers if layers else 1.0,
                                   balancedness_after=after / layers if layers else 1.0)
