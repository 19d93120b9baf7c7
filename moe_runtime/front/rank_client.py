"""Worker ranks in other processes (or on other nodes) behind the front's core-client interface.

`processes.launcher` starts them and waits until every rank is ready; this client sends the front's
commands on the control plane (ZeroMQ + CURVE), takes in the ranks' messages, and watches that every
rank is alive. A rank that fails or dies ends the job: the others are stopped and the reason is the
first one seen (a rank whose collective broke because a peer died names that peer).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Callable

import torch.distributed as dist

from moe_runtime.attention_dp.control_plane import RankDisconnected
from moe_runtime.attention_dp.messages import AdmittedElsewhere, Hello, Message, RebalanceNow, Shutdown, WorkerFailed
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.security.socket_guard import HEARTBEAT_INTERVAL_MS
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.core_client import CoreShape
from moe_runtime.front.rank_reform import (LostRanks, RanksLostMeanwhile, ReformFailed, ReformOutcome, find_lost,
                                           reform_survivors, take_back, take_in_disconnects)
from moe_runtime.processes.distributed import FRONT_STORE
from moe_runtime.processes.launcher import LaunchedJob, launch_job
from moe_runtime.processes.reform import can_reform

logger = logging.getLogger(__name__)

DEATH_REPORT_GRACE_S = 0.3  # after a rank exits, time for its last message (WorkerFailed) to be taken in
NODE_LOSS_GRACE_S = (HEARTBEAT_INTERVAL_MS + 500) / 1000   # across nodes: the other ranks of a lost node
SHUTDOWN_WAIT_S = 10.0      # how long ranks get to leave after Shutdown before they are terminated


class RankClient:
    def __init__(self, config: EngineConfig, world_size: int, tokenizer, vocab_size: int,
                 transfer_key: TransferKey | None, startup_timeout_s: float = 600.0):
        self.tokenizer = tokenizer
        self.job: LaunchedJob = launch_job(config, world_size, transfer_key, startup_timeout_s)
        self.control = self.job.control
        self.vocab_size = vocab_size
        self.config = config
        self.shape = self._shape()
        self._all_ranks = set(self.job.ready)
        self._dead: str | None = None
        self._loop_tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None    # attached: the loop, and whom to tell of a loss
        self._on_lost: Callable[[str], None] | None = None
        self._lost_reported = False
        # a lost rank: the others stay up and re-form without it (`reform`), where the layout allows
        self.reformable = can_reform(config)
        self.generation = 0
        self._store: dist.TCPStore | None = None   # where the ranks of a multi-node job meet when they re-form
        self._failed_rank: int | None = None   # the first rank that reported a failure since the last (re)start
        self._away: set[int] = set()           # ranks lost across nodes, which may come back
        self._back: set[int] = set()           # ... of which these said Hello again

    def _shape(self) -> CoreShape:
        ready = self.job.ready
        first = next(iter(ready.values()))
        return CoreShape(block_size=first.block_size, num_kv_blocks=min(r.num_kv_blocks for r in ready.values()),
                         max_model_len=first.max_model_len, vocab_size=self.vocab_size,
                         pp_size=max(r.pp_rank for r in ready.values()) + 1, worker_ranks=self.job.worker_ranks,
                         kv_shards={rank: r.kv_shard for rank, r in ready.items()}, routing=first.routing)

    def reform(self) -> ReformOutcome:
        """Absorb the lost ranks: the others re-form without them (or, on one node, with fresh processes in their
        place) and this client goes on with them; or, when ranks lost across nodes came back, take them back.
        Blocking: run it off the event loop. Returns how many ranks came back or were lost; raises `ReformFailed`
        when the ranks cannot re-form (the caller restarts or ends)."""
        if not self.reformable:
            raise ReformFailed("this layout cannot absorb a lost rank")
        if self._away and self._back >= self._away:
            return self._take_back()
        # the ranks of a lost node go together: across nodes they are seen by heartbeat, up to an interval apart
        take_in_disconnects(self.job, DEATH_REPORT_GRACE_S if self.job.rendezvous_dir else NODE_LOSS_GRACE_S)
        lost = find_lost(self.job, self._all_ranks, set(self.control.ranks), self._failed_rank, self._dead or "")
        while True:
            self.generation += 1
            try:
                self.job.ready = reform_survivors(self.job, lost, self._all_ranks, self.generation, self._rendezvous(),
                                                  replace=self.job.rendezvous_dir is not None)
                break
            except RanksLostMeanwhile as more:
                if self.job.rendezvous_dir is not None:   # one node: the others may wait in a file store no
                    # interrupt reaches; restart instead (every rank lost so far counted by the recovery)
                    raise RanksLostMeanwhile(set(lost.ranks | more.ranks), str(more)) from more
                # across nodes the front's interrupt breaks its own ranks' wait in the TCP store: once more without them
                logger.warning("%s; re-forming again without them", more)
                lost = LostRanks(lost.ranks | more.ranks, lost.reason)
        self._settle(back_at_layout=bool(lost.ranks & set(self.job.ready)))
        if lost.ranks - set(self.job.ready):   # lost across nodes: they may come back (a node restarted)
            self._away |= lost.ranks - set(self.job.ready)
            self.control.await_return(self._away)
        return ReformOutcome(lost=len(lost.ranks))

    def _take_back(self) -> ReformOutcome:
        returned, self._away, self._back = set(self._back), set(), set()
        self.generation += 1
        self.job.ready = take_back(self.job, self._all_ranks, returned, self.generation, self._rendezvous())
        self._settle(back_at_layout=True)
        return ReformOutcome(returned=len(returned))

    def _settle(self, back_at_layout: bool) -> None:
        self._all_ranks = set(self.job.ready)
        self.shape = self._shape()
        self._dead = None
        self._failed_rank = None
        if back_at_layout:   # the job is back at its layout: its placement is planned afresh over every rank
            self.control.broadcast(RebalanceNow())

    def _came_back(self, rank: int) -> None:
        """A lost rank said Hello again; once all are back, the job re-forms with them (a recovery, like a loss)."""
        self._back.add(rank)
        if self._back >= self._away:
            self._die(f"ranks {sorted(self._back)} are back")

    @property
    def processes(self):
        """The rank processes this front spawned (none for ranks of other nodes or torchrun's)."""
        return self.job.processes

    def resident_expert_bytes(self) -> dict[int, tuple[int, int]]:
        """Rank -> (bytes of routed-expert weights it holds, bytes of all routed experts), as it reported at start."""
        return {rank: (r.expert_bytes, r.total_expert_bytes) for rank, r in self.job.ready.items()}

    def _rendezvous(self) -> str:
        """Where the survivors meet: one node, a new store file in the job's private directory; across nodes, a
        TCP store this front serves on the master address (the first one lived in rank 0, maybe the one lost)."""
        if self.job.rendezvous_dir is not None:
            return f"file://{self.job.rendezvous_dir}/store.{self.generation}"
        if self._store is None:
            self._store = dist.TCPStore(self.config.master_addr, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.config.worker_timeout_s))
        return f"{FRONT_STORE}{self.config.master_addr}:{self._store.port}/{self.generation}"

    # ---- commands ---------------------------------------------------------------------------------
    def send(self, command: Message, only_worker: int | None = None) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            if only_worker is None:
                self.control.broadcast(command)
                return
            ranks = set(self.shape.worker_ranks[only_worker])
            self.control.send(command, ranks)
            self.control.send(AdmittedElsewhere(), self._all_ranks - ranks)
        except RankDisconnected as lost:
            self._die(self.job.describe_lost(lost.rank))

    # ---- the blocking driver ----------------------------------------------------------------------
    def receive(self, timeout: float) -> list[Message]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        messages = []
        message = self._next(timeout)   # returns as soon as a rank reports
        while message is not None:
            messages.append(message)
            message = self._next(0)
        return messages

    def pending(self) -> list[Message]:
        return self.receive(0)

    def _next(self, timeout: float) -> Message | None:
        try:
            received = self.control.receive(timeout)
        except RankDisconnected as lost:
            if lost.rank not in self._all_ranks:   # a rank lost before the last re-formation
                return None
            self._die_with_last_words(self.job.describe_lost(lost.rank), lost.rank)
        if received is None:
            for rank, process in self.job.processes.items():
                if not process.is_alive():
                    self._die_with_last_words(f"worker rank {rank} died (exit code {process.exitcode})", rank)
            return None
        rank, message = received
        if isinstance(message, Hello):
            self._came_back(rank)
            return None
        if isinstance(message, WorkerFailed):
            if message.generation < self.generation:
                return None   # the broken job's last words: the re-formed one goes on
            self._die(self.job.root_cause(message), message.traceback, message.rank)
        return message

    def _die_with_last_words(self, reason: str, rank: int):
        """A rank that raised sends WorkerFailed and then exits: prefer its message to a bare exit code."""
        failed = self.job.last_words(1.0)
        if failed is not None:
            self._die(self.job.root_cause(failed), failed.traceback, failed.rank)
        self._die(reason, rank=rank)

    def _die(self, reason: str, detail: str = "", rank: int | None = None):
        """The job is broken: stop every rank, or, where the others can absorb the loss, only record it."""
        if self._failed_rank is None:
            self._failed_rank = rank
        if self._dead is None:
            self._dead = reason
            logger.error("%s; %s%s", reason, "the other ranks wait to re-form" if self.reformable else
                         "stopping the other ranks", f"\n{detail}" if detail else "")
            if not self.reformable:
                self.job.kill()
            if self._loop is not None:   # attached: a loss a send met is reported too (from any thread)
                self._loop.call_soon_threadsafe(self._report_lost)
        raise EngineDeadError(self._dead)

    # ---- the loop driver --------------------------------------------------------------------------
    def attach(self, on_messages: Callable[[list[Message]], None], on_lost: Callable[[str], None]) -> None:
        """The control socket is registered with the running loop: each rank message is taken in as it
        arrives (no thread, no polling); rank processes' exits and closed connections are awaited too."""
        loop = asyncio.get_running_loop()
        self.control.attach_to_loop()
        self._loop, self._on_lost, self._lost_reported = loop, on_lost, False
        self._loop_tasks = [loop.create_task(self._take_messages(on_messages)), loop.create_task(self._watch_ranks())]

    def _report_lost(self) -> None:
        """`on_lost` once per loss, whichever part of the client saw it first (a send, the reader, the watcher)."""
        if self._on_lost is not None and not self._lost_reported:
            self._lost_reported = True
            self._on_lost(self._dead)

    async def _take_messages(self, on_messages) -> None:
        try:
            while self._dead is None:
                rank, message = await self.control.receive_async()
                if isinstance(message, WorkerFailed) and message.generation < self.generation:
                    continue   # the broken job's last words: the re-formed one goes on
                if isinstance(message, Hello):
                    self._stop_after_return(rank)
                    if self._dead is not None:
                        break
                    continue
                if isinstance(message, WorkerFailed):
                    await asyncio.to_thread(self._stop_after_failure, message)
                    break
                on_messages([message])
        except RankDisconnected:
            return  # _watch_ranks names the rank
        except Exception as exc:  # noqa: BLE001 - the front cannot go on without its ranks' messages
            logger.exception("control-plane reader failed")
            self._stop_after(f"the front lost its control plane: {exc}")
        self._report_lost()

    async def _watch_ranks(self) -> None:
        """Wake when a local rank process exits or any rank's connection closes; then stop the job."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future = loop.create_future()
        for rank, process in self.job.processes.items():
            loop.add_reader(process.sentinel, lambda r=rank: exited.done() or exited.set_result(r))
        try:
            while True:
                disconnected = loop.create_task(self.control.wait_for_disconnect())
                await asyncio.wait([exited, disconnected], return_when=asyncio.FIRST_COMPLETED)
                rank = exited.result() if exited.done() else disconnected.result()
                if rank in self._all_ranks:
                    break
                # else the connection of a rank lost before the last re-formation closed: watch on
        finally:
            for process in self.job.processes.values():
                loop.remove_reader(process.sentinel)
            disconnected.cancel()
        await asyncio.sleep(DEATH_REPORT_GRACE_S)  # a rank that raised sends WorkerFailed just before exiting
        if self._dead is None:
            await asyncio.to_thread(lambda: self._stop_after(self.job.describe_lost(rank), rank=rank))
        self._report_lost()

    def _stop_after_return(self, rank: int) -> None:
        try:
            self._came_back(rank)
        except EngineDeadError:
            pass

    def _stop_after_failure(self, failed: WorkerFailed) -> None:
        """A rank's WorkerFailed (naming the dead peer first can take a second: run in a thread)."""
        self._stop_after(self.job.root_cause(failed), failed.traceback, failed.rank)

    def _stop_after(self, reason: str, detail: str = "", rank: int | None = None) -> None:
        try:
            self._die(reason, detail, rank)
        except EngineDeadError:
            pass

    def detach(self) -> None:
        for task in self._loop_tasks:
            task.cancel()
        self._loop_tasks = []
        self._loop = self._on_lost = None
        self.control.detach_from_loop()

    # ---- state and tear-down ----------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.control is None:
            return
        self.control.detach_from_loop()  # the loop that used it may be gone: shut down with blocking sends
        if self._dead is None:
            try:
                self.control.broadcast(Shutdown())
            except RankDisconnected:
                pass
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            for process in self.job.processes.values():
                process.join(timeout=max(deadline - time.monotonic(), 0.1))
            # ranks started elsewhere (another node, torchrun) must read the Shutdown before the socket goes
            self.control.wait_for_ranks_to_leave(max(deadline - time.monotonic(), 0.1))
        self.job.kill()
        self.control.close()  # remote ranks see the connection close and exit
        self.job.remove_rendezvous()
        self.control = None
