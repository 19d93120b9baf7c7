"""Start a job's worker ranks and wait until every rank is ready: the process half of the ranks' core client.

On one node the front spawns every rank (a fork server that has imported torch and the engine once);
the ranks meet in a private file store and a loopback-only control socket keyed with a fresh secret.
Across nodes, or with ranks torchrun starts, the ranks connect to the front's TCP control port with the
job's shared key. Either way each rank says Hello, gets its `WorkerSetup`, builds its share of the model
and answers `WorkerReady`. Secrets reach the ranks this front spawns through their process arguments (never
over the control plane); ranks started elsewhere read them from their own key files or environment.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

from moe_runtime.security.control_key import ControlKey
from moe_runtime.attention_dp.control_plane import (ControlAddress, FrontControl, RankDisconnected,
                                                    heartbeat_timeout_from_env)
from moe_runtime.attention_dp.messages import WorkerFailed, WorkerReady, WorkerSetup
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.processes.distributed import free_port
from moe_runtime.kernels.thread_pool import ThreadPlan
from moe_runtime.processes.worker import worker_main

logger = logging.getLogger(__name__)

# What the workers' fork server imports once. `transformers.activations` is what a model's config class pulls
# in when the checkpoint's config is read (2-3 s of imports behind transformers' lazy modules).
WORKER_PRELOAD = ("torch", "transformers", "transformers.activations", "moe_runtime.processes.worker",
                  "moe_runtime.engine.core", "moe_runtime.attention_dp.lockstep", "moe_runtime.moe.executor")
READY_POLL_S = 0.2   # start-up: how long one wait for a rank's message lasts before the deadline is looked at


@contextmanager
def main_module_hidden():
    """Start workers without re-running the user's script in them.

    Spawned children normally re-import `__main__` (so a script without an `if __name__ ==
    "__main__"` guard would start the job again in every worker). The workers' entry point lives
    in this package and needs nothing from `__main__`, so its file is hidden while they start.
    """
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        if "__file__" in saved:
            delattr(main, "__file__")
        main.__spec__ = None
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def worker_context():
    """Workers fork from a server process that has already imported torch and the engine (started
    once per front process): a new job's ranks start in well under a second instead of re-importing
    torch each. Forking from that clean server, never from the front, keeps CUDA and threads sane."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


@dataclass(frozen=True)
class RankSpawner:
    """Starts this node's rank processes from the workers' fork server."""

    context: object
    address: ControlAddress        # the control socket as the ranks on this node reach it
    transfer_key: TransferKey | None

    def spawn(self, rank: int) -> mp.Process:
        process = self.context.Process(target=worker_main, args=(self.address, rank, self.transfer_key),
                                       name=f"moe-worker-{rank}", daemon=True)
        with main_module_hidden():
            process.start()
        return process


@dataclass
class LaunchedJob:
    """A started job: its control socket, the ranks this process spawned, every rank's `WorkerReady`."""

    control: FrontControl
    processes: dict[int, mp.Process]
    ready: dict[int, WorkerReady]
    rendezvous_dir: str | None
    spawner: "RankSpawner | None" = None   # starts a rank on this node (a lost one's replacement)

    @property
    def worker_ranks(self) -> dict[int, list[int]]:
        """DP worker -> its ranks (every stage), in rank order."""
        ranks: dict[int, list[int]] = {}
        for rank in sorted(self.ready):
            ranks.setdefault(self.ready[rank].dp_rank, []).append(rank)
        return ranks

    def kill(self) -> None:
        """Terminate the ranks this process spawned (then kill what does not exit within 5 s)."""
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self.processes.values():
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join(timeout=1)

    def root_cause(self, failed: WorkerFailed) -> str:
        """A rank whose collective broke because a peer died reports first: name the dead peer."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, process in self.processes.items():
                if rank != failed.rank and process.exitcode not in (None, 1):
                    return (f"worker rank {rank} died (exit code {process.exitcode}); "
                            f"rank {failed.rank} then failed: {failed.error}")
            time.sleep(0.05)
        return f"worker rank {failed.rank} failed: {failed.error}"

    def last_words(self, timeout_s: float) -> WorkerFailed | None:
        """A rank that raised sends WorkerFailed and then exits: its message, if it arrives within `timeout_s`
        (other messages are dropped: the job is ending)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                received = self.control.receive(0.1)
            except RankDisconnected:
                continue
            if received is not None and isinstance(received[1], WorkerFailed):
                return received[1]
        return None

    def describe_lost(self, rank: int) -> str:
        process = self.processes.get(rank)
        if process is not None:
            process.join(timeout=1.0)
            return f"worker rank {rank} died (exit code {process.exitcode})"
        return f"worker rank {rank} lost its connection to the front (its process or node died)"

    def remove_rendezvous(self) -> None:
        if self.rendezvous_dir:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None


def launch_job(config: EngineConfig, world: int, transfer_key: TransferKey | None, timeout_s: float) -> LaunchedJob:
    """Start (or, for other nodes and torchrun, await) every rank; returns once all are ready.

    `transfer_key`: a P/D instance's KV transfer key, handed to the ranks spawned here with their arguments."""
    nnodes = config.nnodes
    if world % nnodes:
        raise InvalidRequestError(f"nnodes={nnodes} must divide the {world} ranks of this layout")
    local_ranks = world // nnodes if config.launch_workers else 0  # the front's node starts [0, local)
    heartbeat_timeout = config.control_heartbeat_timeout_ms(heartbeat_timeout_from_env)   # travels with the address
    rendezvous_dir: str | None = None
    if nnodes == 1 and config.launch_workers:
        # every rank is our child: a fresh secret, and nothing of the job listens beyond loopback
        # (torch.distributed meets in a file store in a private directory, not a TCP store)
        key = ControlKey.generate()
        rendezvous_dir = tempfile.mkdtemp(prefix="moe-rendezvous-")  # mode 0700
        rendezvous, master_port = f"file://{rendezvous_dir}/store", 0
        address = ControlAddress.ipc(f"{rendezvous_dir}/control", key, heartbeat_timeout)
    else:  # other nodes' or torchrun's ranks connect to master_addr:control_port with the shared key
        key = ControlKey.shared(config.control_key_file)
        rendezvous, master_port = "env://", config.master_port or free_port(config.master_addr)
        address = ControlAddress.tcp(config.master_addr, config.control_port or master_port + 1, key, heartbeat_timeout)
    setup = WorkerSetup(config=config, world_size=world, rendezvous=rendezvous, master_addr=config.master_addr,
                        master_port=master_port,
                        num_threads=ThreadPlan.for_rank(0, world // nnodes).threads,   # each rank decides its own
                        log_level=logging.getLogger().getEffectiveLevel(),
                        loopback_only=rendezvous_dir is not None)
    control = FrontControl(address, setup)
    local_address = control.address.for_local_ranks()
    spawner = RankSpawner(worker_context(), local_address, transfer_key)
    processes = {rank: spawner.spawn(rank) for rank in range(local_ranks)}
    layout = config.layout()
    logger.info("started %d of %d worker ranks (ep=%d, dp_attn=%d, tp=%d, pp=%d), rendezvous %s, control %s",
                local_ranks, world, layout.ep, layout.dp_attn, layout.tp, layout.pp,
                rendezvous if rendezvous_dir else f"{config.master_addr}:{master_port}", control.address.endpoint)
    job = LaunchedJob(control, processes, {}, rendezvous_dir, spawner)
    try:
        _await_ready(job, world, timeout_s)
    except BaseException:
        job.kill()
        control.close()
        job.remove_rendezvous()
        raise
    return job


def _await_ready(job: LaunchedJob, world: int, timeout_s: float) -> None:
    """Collect every rank's WorkerReady; a rank that fails or exits first ends the start-up with its reason."""
    deadline = time.monotonic() + timeout_s
    while len(job.ready) < world:
        if time.monotonic() > deadline:
            raise EngineDeadError(f"worker ranks {sorted(set(range(world)) - set(job.ready))} "
                                  f"did not start within {timeout_s:.0f}s")
        try:
            received = job.control.receive(READY_POLL_S)
        except RankDisconnected as lost:
            raise EngineDeadError(job.describe_lost(lost.rank)) from None
        if received is None:
            for rank, process in job.processes.items():
                if not process.is_alive():
                    failed = job.last_words(1.0)   # a rank that raised sends WorkerFailed just before exiting
                    raise EngineDeadError(job.root_cause(failed) if failed is not None else
                                          f"worker rank {rank} died while starting (exit code {process.exitcode})")
            continue
        message = received[1]
        if isinstance(message, WorkerReady):
            job.ready[message.rank] = message
            logger.info("rank %d ready (%d/%d)", message.rank, len(job.ready), world)
        elif isinstance(message, WorkerFailed):
            logger.error("worker rank %d failed while starting:\n%s", message.rank, message.traceback)
            raise EngineDeadError(job.root_cause(message))
        else:
            logger.warning("rank message %s before the job started; dropped", type(message).__name__)
