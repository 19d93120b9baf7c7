"""The front's side of absorbing lost ranks: name them, tell the survivors to re-form, await them ready.

The survivors keep their processes and weights (moe_runtime/processes/reform.py): the pause is a new rendezvous,
the experts no survivor held loaded from the checkpoint, and the resumed requests' recompute, not a reload of
the model. A failure on the way (the survivors cannot hold every expert, another rank is lost meanwhile, a
survivor does not answer) raises `ReformFailed`; the caller then restarts the whole job or ends it.
"""
from __future__ import annotations

import logging
import os
import time

import msgspec
from dataclasses import dataclass

from moe_runtime.attention_dp.control_plane import RankDisconnected
from moe_runtime.attention_dp.messages import Reform, WorkerFailed, WorkerReady
from moe_runtime.processes.collective_interrupt import INTERRUPT_SIGNAL
from moe_runtime.processes.launcher import LaunchedJob

logger = logging.getLogger(__name__)

REFORM_TIMEOUT_S = 600.0   # survivors re-form (and replacements load their share of the model) within this


class ReformFailed(Exception):
    pass


class RanksLostMeanwhile(ReformFailed):
    """Members were lost while the others re-formed: another generation goes on without them too. Raised out of
    `RankClient.reform`, `ranks` are all the ranks this recovery lost (the first ones included)."""

    def __init__(self, ranks: set[int], reason: str):
        super().__init__(reason)
        self.ranks = ranks


@dataclass(frozen=True)
class ReformOutcome:
    """What a re-formation did: ranks that came back (`returned`), or the ranks it went on without (`lost`: the
    first loss's and any lost meanwhile)."""

    returned: int = 0
    lost: int = 0


@dataclass(frozen=True)
class LostRanks:
    """Which ranks the job lost, and why."""

    ranks: frozenset[int]
    reason: str


def find_lost(job: LaunchedJob, members: set[int], connected: set[int], failed_rank: int | None,
              reason: str) -> LostRanks:
    """The members whose process exited or whose connection closed; with none, the rank that failed first
    (a rank whose own step raised: the others only saw their collectives break)."""
    lost = {rank for rank in members if rank not in connected
            or (rank in job.processes and not job.processes[rank].is_alive())}
    if not lost and failed_rank is not None:
        lost = {failed_rank}
    return LostRanks(frozenset(lost), reason)


def reform_survivors(job: LaunchedJob, lost: LostRanks, members: set[int], generation: int, rendezvous: str,
                     replace: bool = False) -> dict[int, WorkerReady]:
    """Stop what is left of the lost ranks; with `replace` (ranks this front starts), start a fresh process for
    each, which joins the others' re-formation at the job's full size, else the others go on without them.
    Interrupt the survivors this front started (a collective they are blocked in may wait on a peer that is gone
    without closing its connections: processes/collective_interrupt.py), send them `Reform`, and return the
    WorkerReady of every member (by rank)."""
    survivors = sorted(members - lost.ranks)
    if not survivors:
        raise ReformFailed("no rank is left")
    for rank in lost.ranks:
        process = job.processes.pop(rank, None)
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=5)
    joiners = sorted(lost.ranks) if replace else []
    new_members = sorted(survivors + joiners)
    if joiners and new_members != list(range(len(new_members))):   # a replacement takes its lost rank's place
        raise ReformFailed(f"replacements join a job of ranks 0..n-1 only, not {new_members}")
    for rank in joiners:   # answered, when it says Hello, with where and as which generation to join
        job.control.readmit(rank, msgspec.structs.replace(job.control.setup, rendezvous=rendezvous,
                                                          world_size=len(new_members), generation=generation))
        job.processes[rank] = job.spawner.spawn(rank)
    logger.warning("%s; ranks %s re-form %s ranks %s (generation %d)", lost.reason, survivors,
                   "with fresh processes for" if joiners else "without", sorted(lost.ranks), generation)
    # across nodes a survivor may be blocked on a peer whose link was cut (no connection closes): interrupt it;
    # on one node the lost processes exited, and their closed connections free every peer
    return _reform(job, survivors, new_members, joiners, generation, rendezvous, interrupt=job.rendezvous_dir is None)


def take_back(job: LaunchedJob, members: set[int], returned: set[int], generation: int,
              rendezvous: str) -> dict[int, WorkerReady]:
    """Lost ranks came back (their node restarted with the job's key, each has said Hello and waits): answer them
    with the generation to join and re-form the job with them; the WorkerReady of every member."""
    new_members = sorted(members | returned)
    if new_members != list(range(len(new_members))):
        raise ReformFailed(f"ranks that come back rejoin a job of ranks 0..n-1 only, not {new_members}")
    for rank in sorted(returned):
        job.control.answer(rank, msgspec.structs.replace(job.control.setup, rendezvous=rendezvous,
                                                         world_size=len(new_members), generation=generation))
    logger.warning("ranks %s are back: the job re-forms at its full size (generation %d)", sorted(returned), generation)
    return _reform(job, sorted(members), new_members, sorted(returned), generation, rendezvous, interrupt=False,
                   agreed=True)


def _reform(job: LaunchedJob, survivors: list[int], members: list[int], joiners: list[int], generation: int,
            rendezvous: str, interrupt: bool, agreed: bool = False) -> dict[int, WorkerReady]:
    """Send the survivors `Reform` (with `interrupt`, the ones this front started interrupted first), await every
    member ready. Healthy ranks (taking back returned ones: `agreed`) leave together at a lock-step boundary."""
    try:
        for rank in survivors:
            interrupted = interrupt and rank in job.processes
            if interrupted:
                os.kill(job.processes[rank].pid, INTERRUPT_SIGNAL)
            job.control.send(Reform(generation=generation, members=members, rendezvous=rendezvous,
                                    interrupted=interrupted, joiners=joiners, agreed=agreed), {rank})
    except RankDisconnected as gone:
        raise RanksLostMeanwhile({gone.rank}, f"rank {gone.rank} was lost too") from None
    return _await_ready(job, set(members), generation)


def take_in_disconnects(job: LaunchedJob, wait_s: float) -> None:
    """Let the control plane see every connection that closed within `wait_s` (the ranks of a lost node go
    together); what the broken job's ranks sent meanwhile is dropped."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            job.control.receive(min(max(deadline - time.monotonic(), 0), 0.05))
        except RankDisconnected:
            pass


def _await_ready(job: LaunchedJob, survivors: set[int], generation: int) -> dict[int, WorkerReady]:
    ready: dict[int, WorkerReady] = {}
    deadline = time.monotonic() + REFORM_TIMEOUT_S
    while len(ready) < len(survivors):
        if time.monotonic() > deadline:
            raise ReformFailed(f"ranks {sorted(survivors - set(ready))} did not re-form within {REFORM_TIMEOUT_S:.0f}s")
        try:
            received = job.control.receive(0.2)
        except RankDisconnected as gone:
            if gone.rank not in survivors:
                continue   # a lost rank's connection closing
            raise RanksLostMeanwhile({gone.rank}, f"rank {gone.rank} was lost while the others re-formed") from None
        if received is None:
            dead = {rank for rank in survivors if rank in job.processes and not job.processes[rank].is_alive()}
            if dead:
                raise RanksLostMeanwhile(dead, f"ranks {sorted(dead)} died while the others re-formed")
            continue
        rank, message = received
        if isinstance(message, WorkerReady) and message.generation == generation:
            ready[rank] = message
        elif isinstance(message, WorkerFailed) and message.generation == generation:
            raise ReformFailed(f"rank {rank} could not re-form: {message.error}")
        # anything else was sent by the broken job (its last outputs, its ranks' broken collectives): dropped
    return ready
