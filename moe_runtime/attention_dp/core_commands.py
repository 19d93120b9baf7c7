"""The front's commands applied to one rank's engine core, and what the rank reports back.

One implementation for both ways a core runs: a worker rank's lock-step loop (`LockstepLoop`) and the
in-process core of a one-rank engine (`moe_runtime.front.inprocess_client`). Either way the front sees
the same messages (`StepOutputs`, `KVImported`, `ExpertLoadReport`, `RebalanceReport`), so it has one
way to take them in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from moe_runtime.attention_dp.messages import (AbortRequest, ActivateImport, AddRequest, AdmittedElsewhere, ExpertLoadReport,
                                               ExpertLoadTables, ImportRequest, KVImported, RebalanceNow, RebalanceReport,
                                               ReleaseExport, ResetPrefixCache, SnapshotExpertLoad, StepOutputs)
from moe_runtime.attention_dp.admin_commands import ADMIN_COMMANDS, apply_admin_command
from moe_runtime.load_balancer.rebalance_event import RebalanceEvent


@dataclass(frozen=True)
class RankRole:
    """Where a rank stands, as far as applying commands and reporting go."""

    rank: int
    dp_rank: int
    reports_outputs: bool        # the worker's leader on the last pipeline stage: it sends StepOutputs
    reports_expert_load: bool    # each stage's first rank of DP worker 0 and EP rank 0: it sends its stage's load
    reports_rebalance: bool      # global rank 0
    pp_rank: int = 0

    @classmethod
    def single(cls) -> "RankRole":
        return cls(rank=0, dp_rank=0, reports_outputs=True, reports_expert_load=True, reports_rebalance=True)


class Rebalancer(Protocol):
    """What the commands need of `load_balancer.LiveRebalancer`."""

    in_progress: bool

    def start(self, trigger: str, fail_on_rank: int | None) -> None: ...


class CoreCommands:
    """Applies commands to `core` (an `EngineCore`) and puts what the front must hear into `report(message)`."""

    def __init__(self, core, role: RankRole, report: Callable[[object], None], rebalancer: Rebalancer | None = None,
                 ep_group=None):
        self.core = core
        self.role = role
        self.report = report
        self.rebalancer = rebalancer
        self.ep_group = ep_group

    @staticmethod
    def starts_work(command) -> bool:
        """A command after which every rank steps (a request was admitted, imported or activated on some worker).
        The same on every rank: the other workers get `AdmittedElsewhere` for an `AddRequest` or an `ImportRequest`
        (an import's first step is empty, its KV still in flight, but a worker stepping alone would wait forever
        in the MoE layers' collectives for the others)."""
        return isinstance(command, (AddRequest, ImportRequest, AdmittedElsewhere, ActivateImport))

    def apply(self, command) -> None:
        core, role = self.core, self.role
        if isinstance(command, AddRequest):
            if command.dp_rank == role.dp_rank:
                core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                 export_kv=command.export_kv, resumed_token_ids=command.resumed_token_ids)
        elif isinstance(command, ImportRequest):
            if command.dp_rank == role.dp_rank:
                core.add_import(command.spec)
        elif isinstance(command, AdmittedElsewhere):
            pass   # another worker's request: this rank only steps with it
        elif isinstance(command, ActivateImport):
            if command.dp_rank == role.dp_rank:
                core.activate_import(command.request_id)
        elif isinstance(command, ReleaseExport):
            if command.dp_rank == role.dp_rank and core.release_export(command.request_id):
                self.report_step([], always=True)   # its blocks are free: the front's router hears it now
        elif isinstance(command, AbortRequest):
            if core.drop_request(command.request_id, command.finish_reason):
                # its blocks are free now: tell the front, which would otherwise hear only at the next step
                self.report_step([], always=True)
        elif isinstance(command, ResetPrefixCache):
            core.reset_prefix_cache()
            self.report_step([], always=True)   # the front's cache-aware router forgets this worker's blocks in order
        elif isinstance(command, RebalanceNow):
            if self.rebalancer is None:
                if role.reports_rebalance:
                    self.report(RebalanceReport(event=RebalanceEvent(
                        -1, "manual", time.time(), 0.0, 0, 1.0, 1.0, ok=False,
                        error="nothing to rebalance: one expert-parallel rank (start with ep > 1)")))
            else:
                self.rebalancer.start("manual", command.fail_on_rank)
        elif isinstance(command, ADMIN_COMMANDS):   # weight updates, sleep, wake: every rank answers
            self.report(apply_admin_command(core, command, role.rank))
            self.report_step([], always=True)   # an update flushed the prefix cache: the front's router forgets it
        elif isinstance(command, SnapshotExpertLoad):
            # summed over the stage's EP group; each pipeline stage's first rank reports its layers
            snapshot = core.expert_load(group=self.ep_group)
            if role.reports_expert_load:
                tables = None if snapshot is None else ExpertLoadTables(**snapshot.to_dict())
                self.report(ExpertLoadReport(tables=tables, stage=role.pp_rank))
        else:
            raise TypeError(f"unknown command {command!r}")

    def report_step(self, deltas: list, always: bool) -> None:
        """Send the front this worker's outputs, stats and prefix-cache changes (from its reporting rank), when
        `always` or the cache changed. Every rank drains its cache's changes, so none piles them up."""
        cache_events = self.core.take_prefix_cache_events()
        if self.role.reports_outputs and (always or cache_events):
            self.report(StepOutputs(rank=self.role.rank, dp_rank=self.role.dp_rank, deltas=deltas,
                                    stats=self.core.worker_stats(), sent_at=time.time(),
                                    cache_events=cache_events or None))

    def report_landed_imports(self) -> None:
        """Every rank of a decode worker reports its own pulls (each pulls its own share of the KV)."""
        for result in self.core.transfers.take_landed():
            self.report(KVImported(rank=self.role.rank, request_id=result.request_id, error=result.error,
                                   num_bytes=result.num_bytes, seconds=result.seconds,
                                   recomputable=result.recomputable))
