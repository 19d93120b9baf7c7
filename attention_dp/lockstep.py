"""The worker loop: all ranks step together, and a rank with nothing to do runs an empty batch.

Every iteration the ranks join one small all-reduce that agrees on (a) how many broadcast
commands every rank has received, so all ranks apply exactly the same commands at the same step
boundary, and (b) whether any rank has work. If any has, every rank runs a forward step (an empty
one when its own DP worker is idle), so no collective in the MoE layers ever waits on an idle
rank. When nobody has work, ranks block on their command queue instead of spinning. A rebalance
in progress is work too: every rank starts and finishes it at the same steps, pipeline stages
included. These agreements are CPU tensors on the world's gloo control group.

On a decode instance of a P/D set, a rank's KV pulls run on its puller's thread; the loop reports
each one's end to the front (`KVImported`, from every rank: each pulls its own share), also while
idle, and the front's `ActivateImport` then starts the request on every rank of the worker at once.
"""
from __future__ import annotations

import logging
import queue
import time

import torch
import torch.distributed as dist

from attention_dp.messages import (AbortRequest, ActivateImport, AddRequest, ExpertLoadReport, ExpertLoadTables,
                                   ImportRequest, KVImported, RebalanceNow, RebalanceReport, ReleaseExport,
                                   ResetPrefixCache, Shutdown, SnapshotExpertLoad, StepOutputs)
from load_balancer.rebalance_event import RebalanceEvent

logger = logging.getLogger(__name__)

IMPORT_POLL_S = 0.005   # idle with KV pulls in flight: how often a rank looks whether one ended


class LockstepLoop:
    def __init__(self, core, commands, results, parallel, rebalancer=None):
        self.core = core
        self.rebalancer = rebalancer  # on every rank or on none (a stage without MoE layers joins, moving nothing)
        self.commands = commands
        self.results = results
        self.parallel = parallel
        # one rank per DP worker talks to the front: on the last pipeline stage, which samples
        self.reports_outputs = parallel.is_worker_leader and parallel.is_last_stage
        self._received: list = []
        self._applied = 0
        self.steps = 0

    def run(self) -> None:
        busy = False
        while True:
            if not busy and self._applied == len(self._received) and not self._shutdown_received():
                self._received.append(self._next_command())  # everyone idle: wait for the front
            self._drain()
            agreed, anyone_busy = self._agree()
            new = self._received[self._applied : agreed]
            self._applied = agreed
            for command in new:
                if isinstance(command, Shutdown):
                    return
                self._apply(command)
            rebalancing = self.rebalancer is not None and self.rebalancer.in_progress  # the same on every rank
            busy = anyone_busy or rebalancing or any(isinstance(c, (AddRequest, ActivateImport)) for c in new)
            if busy:
                self._step()
            self._report_landed_imports()

    def _next_command(self):
        """The front's next command; while KV pulls are in flight, their outcomes are reported as they end
        (a rank-local event: it never enters the agreed command sequence)."""
        while self.core.imports_in_flight:
            try:
                return self.commands.get(timeout=IMPORT_POLL_S)
            except queue.Empty:
                self._report_landed_imports()
        return self.commands.get()

    def _report_landed_imports(self) -> None:
        """Every rank of a decode worker reports its own pulls (each pulls its own share of the KV)."""
        for result in self.core.take_landed_imports():
            self.results.put(KVImported(rank=self.parallel.rank, request_id=result.request_id, error=result.error,
                                        num_bytes=result.num_bytes, seconds=result.seconds))

    def _drain(self) -> None:
        while not self._shutdown_received():  # nothing follows a Shutdown (the front may close right after)
            try:
                self._received.append(self.commands.get_nowait())
            except queue.Empty:
                return

    def _shutdown_received(self) -> bool:
        return bool(self._received) and isinstance(self._received[-1], Shutdown)

    def _agree(self) -> tuple[int, bool]:
        flags = torch.tensor([-len(self._received), int(self.core.has_unfinished())], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.parallel.world_control_group)
        return int(-flags[0]), bool(flags[1])

    def _apply(self, command) -> None:
        if isinstance(command, AddRequest):
            if command.dp_rank == self.parallel.dp_rank:
                self.core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                      export_kv=command.export_kv)
        elif isinstance(command, ImportRequest):
            if command.dp_rank == self.parallel.dp_rank:
                self.core.add_import(command.spec)
        elif isinstance(command, ActivateImport):
            if command.dp_rank == self.parallel.dp_rank:
                self.core.activate_import(command.request_id)
        elif isinstance(command, ReleaseExport):
            if command.dp_rank == self.parallel.dp_rank and self.core.release_export(command.request_id):
                self._report([], always=True)   # its blocks are free: the front's router hears it now
        elif isinstance(command, AbortRequest):
            if self.core.abort(command.request_id, command.finish_reason):
                # its blocks are free now: tell the front, which would otherwise hear only at the next step
                self._report([], always=True)
        elif isinstance(command, ResetPrefixCache):
            self.core.reset_prefix_cache()
            self._report([], always=True)   # the front's cache-aware router forgets this worker's blocks in order
        elif isinstance(command, RebalanceNow):
            if self.rebalancer is None:
                if self.parallel.rank == 0:
                    self.results.put(RebalanceReport(event=RebalanceEvent(
                        -1, "manual", 0.0, 0.0, 0, 1.0, 1.0, ok=False,
                        error="nothing to rebalance: one expert-parallel rank (start with ep > 1)")))
            else:
                self.rebalancer.start("manual", command.fail_on_rank)
        elif isinstance(command, SnapshotExpertLoad):
            # summed over the stage's EP group; each pipeline stage's first rank reports its layers
            snapshot = self.core.expert_load(group=self.parallel.ep_group)
            if self.parallel.ep_rank == 0 and self.parallel.is_worker_leader and self.parallel.dp_rank == 0:
                tables = None if snapshot is None else ExpertLoadTables(**snapshot.to_dict())
                self.results.put(ExpertLoadReport(tables=tables, stage=self.parallel.pp_rank))
        else:
            raise TypeError(f"unknown command {command!r}")

    def _step(self) -> None:
        batch = self.core.schedule()
        phase = "prefill" if batch is None or batch.is_prefill else "decode"
        if self.core.executor.needs_phase_agreement():
            flag = torch.tensor([int(phase == "prefill")], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.parallel.world_control_group)
            phase = "prefill" if flag.item() else "decode"
        deltas = self.core.execute(batch, phase)
        self.steps += 1
        if self.rebalancer is not None:
            event = self.rebalancer.after_step(self.steps)
            if event is not None and self.parallel.rank == 0:  # merged over the stages already
                self.results.put(RebalanceReport(event=event))
        self._report(deltas, always=batch is not None)

    def _report(self, deltas: list, always: bool) -> None:
        """Send the front this worker's outputs, stats and prefix-cache changes (from its reporting rank), when
        `always` or the cache changed. Every rank drains its cache's changes, so none piles them up."""
        cache_events = self.core.take_prefix_cache_events()
        if self.reports_outputs and (always or cache_events):
            self.results.put(StepOutputs(rank=self.parallel.rank, dp_rank=self.parallel.dp_rank, deltas=deltas,
                                         stats=self.core.worker_stats(), sent_at=time.time(),
                                         cache_events=cache_events or None))
