"""The worker loop: all ranks step together, and a rank with nothing to do runs an empty batch.

Every iteration the ranks join one small all-reduce that agrees on (a) how many broadcast
commands every rank has received, so all ranks apply exactly the same commands at the same step
boundary, and (b) whether any rank has work. If any has, every rank runs a forward step (an empty
one when its own DP worker is idle), so no collective in the MoE layers ever waits on an idle
rank. When nobody has work, ranks block on their command queue instead of spinning. A rebalance
in progress is work too: every rank starts and finishes it at the same steps, pipeline stages
included; an admin command (a weight update, sleep) and the commands after it wait until it has
committed or rolled back (its staged copies hold the old weights). These agreements are CPU tensors on the world's gloo control group.

A request with structured output waits for its grammar, which compiles on a thread pool
(`GrammarWaits`), and starts at the same step on every rank of its worker: while any rank has such
a request, the agreement also says whether any does, and a second all-reduce agrees, per DP worker,
on which of them are settled on every rank or past their deadline on some (`_start_grammars`). An
idle world waits for that on its command queue up to `GRAMMAR_WAIT_S` at a time, not forever: a
compile ending on one rank wakes only that rank, and the others must come to the agreement too.

On a decode instance of a P/D set, a rank's KV pulls run on its puller's thread, which wakes the loop
when one ends (`commands.wake()`: no polling); the loop reports each one's end to the front
(`KVImported`, from every rank: each pulls its own share), also while idle, and the front's
`ActivateImport` then starts the request on every rank of the worker at once. What a command does
to the core is `CoreCommands`' (shared with the in-process core of a one-rank engine).
"""
from __future__ import annotations

import logging
import queue

import torch
import torch.distributed as dist

from moe_runtime.attention_dp.admin_commands import ADMIN_COMMANDS
from moe_runtime.attention_dp.control_plane import Woken
from moe_runtime.attention_dp.core_commands import CoreCommands, RankRole
from moe_runtime.attention_dp.messages import RebalanceReport, Reform, Shutdown
from moe_runtime.sampling.structured_output.grammar_waits import AGREEMENT_WINDOW, Readiness

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005   # an idle world with grammars compiling comes back to the agreement this often


class ReformRequested(Exception):
    """The front's `Reform` arrived: the loop ends where it stands (its job lost a rank; nothing more is agreed
    over the old groups), and the commands after it stay queued for the re-formed job's loop."""

    def __init__(self, reform: Reform):
        super().__init__(f"re-form as generation {reform.generation} over ranks {reform.members}")
        self.reform = reform


class LockstepLoop:
    def __init__(self, core, commands, results, parallel, rebalancer=None):
        self.core = core
        self.rebalancer = rebalancer  # on every rank or on none (a stage without MoE layers joins, moving nothing)
        self.commands = commands
        self.parallel = parallel
        # one rank per DP worker talks to the front: on the last pipeline stage, which samples
        role = RankRole(rank=parallel.rank, dp_rank=parallel.dp_rank,
                        reports_outputs=parallel.is_worker_leader and parallel.is_last_stage,
                        reports_expert_load=(parallel.ep_rank == 0 and parallel.is_worker_leader
                                             and parallel.dp_rank == 0),
                        reports_rebalance=parallel.rank == 0, pp_rank=parallel.pp_rank)
        self.applier = CoreCommands(core, role, results.put, rebalancer, ep_group=parallel.ep_group)
        self.results = results
        core.wake = commands.wake   # a KV pull ended (puller thread): the loop reports it at once
        self._received: list = []
        self._applied = 0
        self.steps = 0

    def run(self) -> None:
        busy = grammars_waiting = False
        while True:
            if not busy and self._applied == len(self._received) and not self._shutdown_received():
                # everyone idle: wait for the front (briefly while grammars compile somewhere)
                command = self._next_command(GRAMMAR_WAIT_S if grammars_waiting else None)
                if command is not None:
                    self._received.append(command)
            self._drain()
            agreed, anyone_busy, grammars_waiting = self._agree()
            new = self._received[self._applied : agreed]
            self._applied = agreed
            for index, command in enumerate(new):
                if isinstance(command, Shutdown):
                    return
                if isinstance(command, Reform):   # agreed: every rank leaves at this boundary, no collective in flight
                    raise ReformRequested(command)
                if isinstance(command, ADMIN_COMMANDS) and self._migrating():
                    # a multi-step rebalance has staged copies of the old weights (committed at its end): a weight
                    # update or sleep waits for it to commit or roll back, and so does every command after it
                    self._applied -= len(new) - index
                    new = new[:index]
                    break
                self.applier.apply(command)
            if grammars_waiting:
                self._start_grammars()   # their requests step from the next agreement on (anyone_busy)
            busy = anyone_busy or self._migrating() or any(CoreCommands.starts_work(c) for c in new)
            if busy:
                self._step()
            self.applier.report_landed_imports()

    def _migrating(self) -> bool:
        """A rebalance is in progress (the same on every rank: they start and finish it at the same steps)."""
        return self.rebalancer is not None and self.rebalancer.in_progress

    def _next_command(self, timeout: float | None = None):
        """The front's next command; a KV pull that ends meanwhile wakes the wait and is reported at once
        (a rank-local event: it never enters the agreed command sequence). With `timeout`: None when none
        came by then, or when a wake came (a grammar compile ended here: time to agree on it)."""
        while True:
            try:
                command = self.commands.get(timeout=timeout)
            except queue.Empty:
                return None
            if isinstance(command, Reform) and not command.agreed:
                raise ReformRequested(command)
            if not isinstance(command, Woken):
                return command
            self.applier.report_landed_imports()
            if timeout is not None:
                return None

    def _drain(self) -> None:
        while not self._shutdown_received():  # nothing follows a Shutdown (the front may close right after)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Reform) and not command.agreed:
                raise ReformRequested(command)
            if not isinstance(command, Woken):
                self._received.append(command)

    def _shutdown_received(self) -> bool:
        return bool(self._received) and isinstance(self._received[-1], Shutdown)

    def _agree(self) -> tuple[int, bool, bool]:
        """(commands every rank has, whether any rank has work, whether any rank has requests waiting for
        their grammars)."""
        flags = torch.tensor([-len(self._received), int(self.core.has_unfinished()),
                              int(self.core.waiting_for_grammars)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.parallel.world_control_group)
        return int(-flags[0]), bool(flags[1]), bool(flags[2])

    def _start_grammars(self) -> None:
        """Agree, per DP worker, on its first waiting requests: settled on all of its ranks (MAX of -settled is
        -1 only if every rank says 1) and past the deadline on any (MAX of expired). Rows of other workers are
        filled with what changes nothing (settled, not expired), so one all-reduce over the world serves all."""
        view = self.core.grammar_readiness()
        readiness = torch.zeros(self.parallel.dp_size, AGREEMENT_WINDOW, 2, dtype=torch.int64)
        readiness[:, :, 0] = -1
        for i, local in enumerate(view):
            readiness[self.parallel.dp_rank, i, 0] = -int(local.settled)
            readiness[self.parallel.dp_rank, i, 1] = int(local.expired)
        dist.all_reduce(readiness, op=dist.ReduceOp.MAX, group=self.parallel.world_control_group)
        mine = readiness[self.parallel.dp_rank]
        self.core.start_grammars([Readiness(settled=bool(mine[i, 0] == -1), expired=bool(mine[i, 1]))
                                  for i in range(len(view))])

    def _step(self) -> None:
        batch = self.core.schedule()
        # only ranks with work vote: an idle rank follows, so DeepEP's low-latency mode runs whenever every
        # busy rank decodes (an idle vote for prefill would force normal mode whenever any worker is idle); a
        # worker verifying drafts decodes too (`ScheduledBatch.phase`), beside plain decodes and idle workers
        phase = "prefill" if batch is not None and batch.is_prefill else "decode"
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
        self.applier.report_step(deltas, always=batch is not None)
