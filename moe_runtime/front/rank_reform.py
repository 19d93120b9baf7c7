"""The front's side of absorbing lost ranks: name them, tell the survivors to re-form, await them ready.

The survivors keep their processes and weights (moe_runtime/processes/reform.py): the pause is a new rendezvous,
the experts no survivor held loaded from the checkpoint, and the resumed requests' recompute, not a reload of
the model. A failure on the way (the survivors cannot hold every expert, another rank is lost meanwhile, a
survivor does not answer) raises `ReformFailed`; the caller then restarts the whole job or ends it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from attention_dp.control_plane import RankDisconnected
from attention_dp.messages import Reform, WorkerFailed, WorkerReady
from moe_runtime.processes.launcher import LaunchedJob

logger = logging.getLogger(__name__)

REFORM_TIMEOUT_S = 120.0   # survivors re-form and reload their lost experts within this


class ReformFailed(Exception):
    pass


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


def reform_survivors(job: LaunchedJob, lost: LostRanks, members: set[int], generation: int) -> dict[int, WorkerReady]:
    """Stop what is left of the lost ranks, send `Reform` to the survivors, return their WorkerReady (by rank)."""
    survivors = sorted(members - lost.ranks)
    if not survivors:
        raise ReformFailed("no rank is left")
    for rank in lost.ranks:
        process = job.processes.pop(rank, None)
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=5)
    if job.rendezvous_dir is None:
        raise ReformFailed("ranks started elsewhere (other nodes, torchrun) re-form only by a restart of the job")
    rendezvous = f"file://{job.rendezvous_dir}/store.{generation}"
    logger.warning("%s; ranks %s re-form without ranks %s (generation %d)", lost.reason, survivors,
                   sorted(lost.ranks), generation)
    try:
        job.control.send(Reform(generation=generation, members=survivors, rendezvous=rendezvous), set(survivors))
    except RankDisconnected as gone:
        raise ReformFailed(f"rank {gone.rank} was lost too") from None
    return _await_ready(job, set(survivors), generation)


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
            raise ReformFailed(f"rank {gone.rank} was lost while the others re-formed") from None
        if received is None:
            dead = [rank for rank in survivors if rank in job.processes and not job.processes[rank].is_alive()]
            if dead:
                raise ReformFailed(f"rank {dead[0]} died while the others re-formed")
            continue
        rank, message = received
        if isinstance(message, WorkerReady) and message.generation == generation:
            ready[rank] = message
        elif isinstance(message, WorkerFailed) and message.generation == generation:
            raise ReformFailed(f"rank {rank} could not re-form: {message.error}")
        # anything else was sent by the broken job (its last outputs, its ranks' broken collectives): dropped
    return ready
