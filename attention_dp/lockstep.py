"""The worker loop: all ranks step together, and a rank with nothing to do runs an empty batch.

Every iteration the ranks join one small all-reduce that agrees on (a) how many broadcast
commands every rank has received, so all ranks apply exactly the same commands at the same step
boundary, and (b) whether any rank has work. If any has, every rank runs a forward step (an empty
one when its own DP worker is idle), so no collective in the MoE layers ever waits on an idle
rank. When nobody has work, ranks block on their command queue instead of spinning. A rebalance
in progress is work too: every rank starts and finishes it at the same steps, pipeline stages
included. These agreements are CPU tensors on the world's gloo control group.
"""
from __future__ import annotations

import logging
import queue
import time

import torch
import torch.distributed as dist

from attention_dp.messages import (AbortRequest, AddRequest, ExpertLoadReport, ExpertLoadTables, RebalanceNow,
                                   RebalanceReport, Shutdown, SnapshotExpertLoad, StepOutputs)
from load_balancer.live_rebalancer import RebalanceOutcome

logger = logging.getLogger(__name__)


class LockstepLoop:
    def __init__(self, core, commands, results, parallel, rebalancer=None):
        self.core = core
        self.rebalancer = rebalancer if self._every_rank_balances(parallel, rebalancer) else None
        self.commands = commands
        self.results = results
        self.parallel = parallel
        # one rank per DP worker talks to the front: on the last pipeline stage, which samples
        self.reports_outputs = parallel.attn_tp_rank == 0 and parallel.is_last_stage
        self._received: list = []
        self._applied = 0
        self.steps = 0

    def run(self) -> None:
        busy = False
        while True:
            if not busy and self._applied == len(self._received) and not self._shutdown_received():
                self._received.append(self.commands.get())  # everyone idle: wait for the front
            self._drain()
            agreed, anyone_busy = self._agree()
            new = self._received[self._applied : agreed]
            self._applied = agreed
            for command in new:
                if isinstance(command, Shutdown):
                    return
                self._apply(command)
            rebalancing = self.rebalancer is not None and self.rebalancer.in_progress  # the same on every rank
            busy = anyone_busy or rebalancing or any(isinstance(c, AddRequest) for c in new)
            if busy:
                self._step()

    def _drain(self) -> None:
        while not self._shutdown_received():  # nothing follows a Shutdown (the front may close right after)
            try:
                self._received.append(self.commands.get_nowait())
            except queue.Empty:
                return

    def _shutdown_received(self) -> bool:
        return bool(self._received) and isinstance(self._received[-1], Shutdown)

    @staticmethod
    def _every_rank_balances(parallel, rebalancer) -> bool:
        """Whether every rank has a rebalancer: the stages rebalance together or not at all (a stage
        without MoE layers has none)."""
        if parallel.pp_size == 1:
            return rebalancer is not None  # the stage is the job: all ranks built the same
        flag = torch.tensor([int(rebalancer is not None)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=parallel.world_control_group)
        if rebalancer is not None and not flag.item():
            logger.warning("live rebalancing is off: a pipeline stage has no expert-parallel MoE layers")
        return bool(flag.item())

    def _agree(self) -> tuple[int, bool]:
        flags = torch.tensor([-len(self._received), int(self.core.has_unfinished())], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.parallel.world_control_group)
        return int(-flags[0]), bool(flags[1])

    def _apply(self, command) -> None:
        if isinstance(command, AddRequest):
            if command.dp_rank == self.parallel.dp_rank:
                self.core.add_request(command.request_id, command.prompt_token_ids, command.params)
        elif isinstance(command, AbortRequest):
            if self.core.abort(command.request_id, command.finish_reason) and self.reports_outputs:
                # its blocks are free now: tell the front, which would otherwise hear only at the next step
                self.results.put(StepOutputs(rank=self.parallel.rank, dp_rank=self.parallel.dp_rank, deltas=[],
                                             stats=self.core.worker_stats()))
        elif isinstance(command, RebalanceNow):
            if self.rebalancer is None:
                if self.parallel.rank == 0:
                    self.results.put(RebalanceReport(outcome=RebalanceOutcome(
                        "manual", 0.0, 0.0, 0, 1.0, 1.0, ok=False,
                        error="nothing to rebalance: no MoE layers, one EP rank, or a pipeline stage "
                              "without expert-parallel MoE layers"), index=-1))
            else:
                self.rebalancer.start("manual", command.fail_on_rank)
        elif isinstance(command, SnapshotExpertLoad):
            # summed over the stage's EP group; each pipeline stage's first rank reports its layers
            snapshot = self.core.expert_load(group=self.parallel.ep_group)
            if self.parallel.ep_rank == 0 and self.parallel.attn_tp_rank == 0 and self.parallel.dp_rank == 0:
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
            outcome = self.rebalancer.after_step(self.steps)
            if outcome is not None and self.parallel.rank == 0:  # merged over the stages already
                self.results.put(RebalanceReport(outcome=outcome, index=self.rebalancer.count - 1))
        if self.reports_outputs and batch is not None:
            self.results.put(StepOutputs(rank=self.parallel.rank, dp_rank=self.parallel.dp_rank, deltas=deltas,
                                         stats=self.core.worker_stats(), sent_at=time.time()))
