"""Rebalancing while serving: plan from the recorded window, move weights in chunks, switch at once.

Runs inside every worker rank's lock-step loop, so every rank starts, advances and commits a
rebalance at the same step boundary. Each pipeline stage balances its own MoE layers over its EP
group; all stages rebalance together, a stage without MoE layers included (it plans and moves
nothing, but joins every job-wide agreement):
- start: the window's counts are summed over the stage's EP group; the stage's first rank plans
  (`rebalance`, migration-aware) and broadcasts the new placement, so every rank of the stage holds
  the same plan. All ranks of the job agree on how many steps the migration takes (the stage with
  the most layers to move sets it), so every stage finishes at the same step;
- advance: each step moves the weights of `layers_per_step` MoE layers (point-to-point within the
  EP group, staged in each layer's `ExpertStore`), so no step stalls for the whole model;
- commit: all ranks of the job agree (one all-reduce) that every copy arrived; then all commit
  their stores and switch placement together. If any rank failed, every rank discards what it
  staged and the old placement stays in force on every stage; the failure is logged and reported.

Agreement flags, the plan and a failing rank's error text travel over the gloo control groups (CPU
tensors, no pickled objects); expert weights and load counts over the EP data group. The event is
merged over the stages (experts moved summed, balancedness averaged weighted by each stage's MoE
layer count), so global rank 0 reports one `RebalanceEvent` per rebalance.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moe_runtime.load_balancer.balancedness import balancedness
from moe_runtime.load_balancer.expert_store import ExpertStore
from moe_runtime.load_balancer.migration import MigrationPlan, plan_migration
from moe_runtime.load_balancer.placement import Placement
from moe_runtime.load_balancer.rebalance import rebalance
from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.load_balancer.recorder import ExpertLoadRecorder
from moe_runtime.load_balancer.weight_migration import migrate_layer

logger = logging.getLogger(__name__)

ERROR_TEXT_BYTES = 4096     # a rank's error message crosses in at most this much utf-8 (a longer one is cut)


@dataclass(frozen=True)
class RebalancePolicy:
    interval_steps: int = 0          # rebalance every N lock-step steps (0 = off)
    threshold: float = 0.0           # ... or when mean balancedness over layers drops below this (0 = off)
    check_every: int = 32            # steps between threshold checks (each costs one all-reduce)
    layers_per_step: int = 0         # MoE layers migrated per step (0 = all in one step)
    num_nodes: int = 1


@dataclass(frozen=True)
class RebalanceGroups:
    """Where one rank rebalances: its EP group and the control groups the ranks agree over."""

    ep_group: Any                # EP data group: load counts and expert weights
    ep_rank: int                 # this rank in it: the ranks of the placement and the plan
    ep_control_group: Any        # gloo, the stage's ranks: the plan broadcast
    world_control_group: Any     # gloo, every rank of the job: trigger, step count, success
    pp_control_group: Any        # gloo, one rank per stage: merging the event
    num_stages: int
    global_rank: int


class BalancedExperts(Protocol):
    """What live rebalancing needs of one rank's MoE layers (the MoE executor provides it)."""

    placement: Placement | None         # in force; None when this pipeline stage has no MoE layers
    recorder: ExpertLoadRecorder | None

    def expert_store(self, moe_layer: int) -> ExpertStore: ...

    def set_placement(self, placement: Placement) -> None: ...


@dataclass
class _Migration:
    trigger: str
    previous: Placement | None       # None: this stage has no MoE layers
    new: Placement | None
    plan: MigrationPlan | None
    layers_left: list[int]           # MoE layers still to move, in order
    started: float
    before: float
    after: float
    fail_on_rank: int | None
    steps_left: int = 1
    migrated: list[int] = field(default_factory=list)  # MoE layers whose weights are staged
    error: str | None = None

    @property
    def num_moved(self) -> int:
        return 0 if self.plan is None else self.plan.num_moved

    @property
    def num_layers(self) -> int:
        return 0 if self.previous is None else self.previous.num_layers


class LiveRebalancer:
    """One rank's part in live rebalancing."""

    def __init__(self, experts: BalancedExperts, policy: RebalancePolicy, groups: RebalanceGroups):
        self.experts = experts
        self.policy = policy
        self.groups = groups
        self._migration: _Migration | None = None
        self.count = 0

    @property
    def in_progress(self) -> bool:
        return self._migration is not None

    def after_step(self, step: int) -> RebalanceEvent | None:
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
            low = False
            if self.experts.recorder is not None:
                snapshot = self.experts.recorder.snapshot(group=self.groups.ep_group)
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
        previous = self.experts.placement
        if previous is None:
            migration = _Migration(trigger, None, None, None, [], started, 1.0, 1.0, fail_on_rank)
        else:
            migration = self._plan(trigger, previous, started, fail_on_rank)
        migration.steps_left = self._agree(self._steps_for(len(migration.layers_left)), dist.ReduceOp.MAX)
        self._migration = migration

    def _plan(self, trigger: str, previous: Placement, started: float, fail_on_rank: int | None) -> _Migration:
        load = self.experts.recorder.snapshot(group=self.groups.ep_group).counts.float()  # [L, E], the stage's
        phy2log = previous.phy2log.clone()
        if self.groups.ep_rank == 0:
            phy2log = rebalance(load, previous.num_slots, previous.num_ranks, self.policy.num_nodes,
                                previous=previous).phy2log.clone()
        dist.broadcast(phy2log, group=self.groups.ep_control_group, group_src=0)
        new = Placement.from_phy2log(phy2log, previous.num_experts, previous.num_ranks, self.policy.num_nodes)
        plan = plan_migration(previous, new)
        before = float(balancedness(load, previous).mean()) if load.sum() > 0 else 1.0
        after = float(balancedness(load, new).mean()) if load.sum() > 0 else 1.0
        logger.info("rebalance (%s) planned: %d expert weights to move, balancedness %.3f -> %.3f",
                    trigger, plan.num_moved, before, after)
        return _Migration(trigger, previous, new, plan, sorted(set(plan.layer.tolist())), started, before, after,
                          fail_on_rank)

    def _steps_for(self, num_layers: int) -> int:
        per_step = self.policy.layers_per_step
        return max(1, -(-num_layers // per_step)) if per_step else 1

    def advance(self) -> RebalanceEvent | None:
        """Move the next chunk of layers. Ranks first agree that all are ready for it (a rank that
        cannot take part must not leave its peers waiting on a transfer that never comes)."""
        m = self._migration
        chunk = self.policy.layers_per_step or len(m.layers_left)
        todo, m.layers_left = m.layers_left[:chunk], m.layers_left[chunk:]  # empty once this stage is done
        m.steps_left -= 1
        stores: dict[int, ExpertStore] = {}
        try:
            if m.fail_on_rank == self.groups.global_rank:
                raise RuntimeError(f"injected migration failure on rank {self.groups.global_rank}")
            stores = {moe_layer: self.experts.expert_store(moe_layer) for moe_layer in todo}
        except Exception as exc:
            m.error = f"rank {self.groups.global_rank}: {type(exc).__name__}: {exc}"
            logger.error("expert migration cannot proceed: %s", m.error)
        if not self._agree(int(m.error is None), dist.ReduceOp.MIN):
            return self._finish(committed=False)
        for moe_layer, store in stores.items():
            migrate_layer(m.plan, m.previous, moe_layer, store, self.groups.ep_rank, self.groups.ep_group)
            m.migrated.append(moe_layer)
        if m.steps_left > 0:
            return None
        return self._finish(committed=True)

    def _agree(self, value: int, op) -> int:
        """`value` reduced over every rank of the job (the world's gloo control group)."""
        flag = torch.tensor([value], dtype=torch.int64, device="cpu")
        dist.all_reduce(flag, op=op, group=self.groups.world_control_group)
        return int(flag.item())

    def _finish(self, committed: bool) -> RebalanceEvent:
        m = self._migration
        self._migration = None
        stores = [self.experts.expert_store(moe_layer) for moe_layer in m.migrated]
        if committed:
            for store in stores:
                store.commit()
            if m.new is not None:
                self.experts.set_placement(m.new)
            logger.info("rebalance (%s) committed: %d expert weights moved in %.3fs", m.trigger, m.num_moved,
                        time.time() - m.started)
        else:
            for store in stores:
                store.discard()
            m.error = self._first_error(m.error)
            logger.error("rebalance (%s) rolled back, the previous placement stays in force: %s", m.trigger, m.error)
        stage = RebalanceEvent(self.count, m.trigger, m.started, time.time() - m.started,
                               m.num_moved if committed else 0, m.before, m.after if committed else m.before,
                               committed, None if committed else m.error)
        self.count += 1
        return self._merge_stages(stage, m.num_layers)

    def _first_error(self, own: str | None) -> str:
        """The failing rank's own message, on every rank (they only know that some rank failed)."""
        errors = all_gather_text(own, self.groups.world_control_group)
        return next((e for e in errors if e is not None), "another rank could not take part in the migration")

    def _merge_stages(self, stage: RebalanceEvent, num_layers: int) -> RebalanceEvent:
        """The job's event from the stages' (ok and error are the same on all: they agreed)."""
        if self.groups.num_stages == 1:
            return stage
        group = self.groups.pp_control_group
        totals = torch.tensor([stage.experts_moved, stage.balancedness_before * num_layers,
                               stage.balancedness_after * num_layers, num_layers], dtype=torch.float64, device="cpu")
        dist.all_reduce(totals, group=group)
        moved, before, after, layers = totals.tolist()
        longest = torch.tensor([stage.duration_s], dtype=torch.float64, device="cpu")
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        return dataclasses.replace(stage, experts_moved=int(moved), duration_s=float(longest.item()),
                                   balancedness_before=before / layers if layers else 1.0,
                                   balancedness_after=after / layers if layers else 1.0)


def all_gather_text(text: str | None, group) -> list[str | None]:
    """Every rank's `text` (None for a rank without one), in rank order, over `group` (gloo, CPU tensors).

    Tensors only, no pickle on the wire: each rank sends its length (-1 for None) and ERROR_TEXT_BYTES
    of utf-8, the text cut to fit (a character split by the cut is dropped)."""
    world = dist.get_world_size(group)
    raw = b"" if text is None else text.encode("utf-8")[:ERROR_TEXT_BYTES]
    length = torch.tensor([-1 if text is None else len(raw)], dtype=torch.int64)
    data = torch.zeros(ERROR_TEXT_BYTES, dtype=torch.uint8)
    if raw:
        data[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    lengths = [torch.empty_like(length) for _ in range(world)]
    datas = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    dist.all_gather(datas, data, group=group)
    return [None if int(n) < 0 else bytes(d[:int(n)].tolist()).decode("utf-8", errors="ignore")
            for n, d in zip(lengths, datas)]
