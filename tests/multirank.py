"""Multi-rank test harness: a pool of gloo worker processes that runs functions on every rank.

A pool of N worker processes is started once per pytest session per world size and reused by
every test that asks for it, so the cost of starting N processes and rendezvousing a process
group is paid once.

    from multirank import ranks  # noqa: F401  (pytest fixture)

    def _body(scale):                      # module level: it is pickled by reference
        rank = torch.distributed.get_rank()
        return rank * scale

    def test_something(ranks):
        assert ranks(2).run(_body, 10) == [0, 10]

Workers are forked from a forkserver that has imported torch (fresh interpreters, no inherited
threads), so starting and restarting a pool is cheap.

Guarantees:
- every worker has `torch.distributed` initialised (gloo, `env://`, a free loopback port chosen at
  start, never a fixed one) and `torch.set_num_threads(1)`;
- `run(fn, *args)` calls `fn(*args)` on every rank and returns the per-rank results, in rank order;
- an exception on any rank fails the call with that rank's traceback (all failing ranks are shown);
- a rank that does not answer within the timeout fails the call instead of hanging it, and so does a
  rank process that dies;
- after a failure that may leave ranks out of step (a rank hung or died, typically in a collective
  that a failed rank never joined) the pool is torn down and restarted on the next call; when
  every rank answered (some raised, some returned) the ranks are in step and the pool is kept;
- processes are always torn down at the end of the session (and are daemons besides).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from typing import Any, Callable

import pytest

from moe_runtime.processes.launcher import WORKER_PRELOAD

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 120.0
DEFAULT_START_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to report before they are presumed stuck in a
# collective that the failed rank never joined.
FAILURE_GRACE_S = 3.0


class MultiRankError(AssertionError):
    """A function run on the pool raised on some rank, or a rank hung or died."""


@dataclasses.dataclass
class _Reply:
    rank: int
    ok: bool
    payload: bytes  # pickled result when ok, formatted traceback (utf-8) otherwise


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_when_owner_dies(owner_pid: int, poll_s: float = 1.0) -> None:
    """A worker whose pool owner vanished (e.g. pytest killed with SIGKILL) exits instead of
    lingering: its real parent is the forkserver, which outlives the owner in that case."""

    def watch():
        while _process_exists(owner_pid):
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _worker_main(rank: int, world_size: int, port: int, owner_pid: int, tasks, replies) -> None:
    """Entry point of one rank: initialise gloo, then serve tasks until told to stop (None)."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    _exit_when_owner_dies(owner_pid)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
        replies.put(_Reply(rank, True, pickle.dumps("ready")))
    except BaseException:
        replies.put(_Reply(rank, False, traceback.format_exc().encode()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            # Tasks and results travel as plain pickles (not multiprocessing's shared-memory tensor
            # reduction): unpickling errors land in this try, and results are plain copies.
            fn, args, kwargs = pickle.loads(task)
            result = fn(*args, **kwargs)
            reply = _Reply(rank, True, pickle.dumps(result))
        except BaseException:
            reply = _Reply(rank, False, traceback.format_exc().encode())
        replies.put(reply)
    dist.destroy_process_group()


class RankPool:
    """N worker processes forming one gloo process group; see the module docstring."""

    def __init__(self, world_size: int, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"RankPool world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        # forkserver: workers fork from a server that imported torch once, so a restart after a
        # hang costs about a second instead of N fresh interpreters importing torch.
        self._ctx = multiprocessing.get_context("forkserver")
        # one fork server per process: the engine's workers fork from it too, so it preloads what they need
        self._ctx.set_forkserver_preload([*WORKER_PRELOAD, "torch.distributed", __name__])
        self._procs: list = []
        self._tasks: list = []
        self._replies = None
        self._healthy = False

    # ----------------------------------------------------------------------------- lifecycle
    def start(self, attempts: int = 3) -> None:
        """Start the workers; retries with a new port if the rendezvous fails (port race)."""
        last_error: Exception | None = None
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except MultiRankError as err:
                last_error = err
                logger.warning("RankPool(%d) start attempt %d failed: %s", self.world_size,
                               attempt + 1, err)
                self.close(graceful=False)
        raise MultiRankError(f"RankPool({self.world_size}) could not start") from last_error

    def _start_once(self) -> None:
        port = find_free_port()
        self._replies = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(target=_worker_main, name=f"multirank-{self.world_size}-r{rank}",
                              args=(rank, self.world_size, port, os.getpid(), self._tasks[rank],
                                    self._replies),
                              daemon=True)
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(self.start_timeout_s, what="process group start")
        self._healthy = True
        logger.info("RankPool(%d) started on port %d", self.world_size, port)

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: politely first (unless `graceful` is False), then terminate, kill."""
        for task_queue, proc in zip(self._tasks, self._procs):
            if graceful and proc.is_alive():
                try:
                    task_queue.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for q in [*self._tasks, self._replies]:
            if q is not None:
                q.cancel_join_thread()  # undelivered messages to dead workers do not matter
                q.close()
        self._procs, self._tasks, self._replies = [], [], None
        self._healthy = False

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args, timeout_s: float | None = None,
            **kwargs) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order.

        `fn` and its arguments must be picklable (module-level functions, plain data, tensors).
        """
        if not self._healthy:
            self.close()
            self.start()
        task = pickle.dumps((fn, args, kwargs))
        for task_queue in self._tasks:
            task_queue.put(task)
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self.call_timeout_s if timeout_s is None else timeout_s, what=name)

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        """Wait for one reply per rank; raise MultiRankError on errors, hangs or deaths."""
        replies: dict[int, _Reply] = {}
        deadline = time.monotonic() + timeout_s
        first_failure_at: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            if first_failure_at is not None and now > first_failure_at + FAILURE_GRACE_S:
                break
            if now > deadline:
                break
            try:
                reply = self._replies.get(timeout=0.05)
            except queue.Empty:
                if any(not proc.is_alive() for proc in self._procs):
                    # Drain what is already queued before declaring the death.
                    self._drain_into(replies)
                    break
                continue
            replies[reply.rank] = reply
            if not reply.ok and first_failure_at is None:
                first_failure_at = time.monotonic()

        failed = sorted(r for r, rep in replies.items() if not rep.ok)
        missing = sorted(set(range(self.world_size)) - set(replies))
        if not failed and not missing:
            return [pickle.loads(replies[r].payload) for r in range(self.world_size)]

        # Every rank answered: they are in step, keep the pool. A missing rank: restart next call.
        self._healthy = not missing
        message = [f"{what}: failed on ranks {failed}" if failed else f"{what}: no failure report"]
        for rank in missing:
            proc = self._procs[rank] if rank < len(self._procs) else None
            if proc is not None and not proc.is_alive():
                message.append(f"rank {rank} died (exit code {proc.exitcode})")
            else:
                message.append(f"rank {rank} did not answer within "
                               f"{timeout_s if first_failure_at is None else FAILURE_GRACE_S:.1f}s"
                               " (hung)")
        for rank in failed:
            message.append(f"----- rank {rank} traceback -----\n"
                           + replies[rank].payload.decode(errors="replace"))
        if missing:
            self.close(graceful=False)
        raise MultiRankError("\n".join(message))

    def _drain_into(self, replies: dict[int, _Reply]) -> None:
        time.sleep(0.2)
        while True:
            try:
                reply = self._replies.get_nowait()
            except queue.Empty:
                return
            replies[reply.rank] = reply


class RankPools:
    """One lazily started RankPool per world size, closed together."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = RankPool(world_size)
            pool.start()
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_POOLS_KEY = pytest.StashKey[RankPools]()


@pytest.fixture(scope="session")
def ranks(request) -> RankPools:
    """`ranks(n)` -> the session's RankPool of world size n (started on first use).

    The pools live in the pytest config stash, so several test modules importing this fixture
    still share one pool per world size.
    """
    config = request.config
    pools = config.stash.get(_POOLS_KEY, None)
    if pools is None:
        pools = RankPools()
        config.stash[_POOLS_KEY] = pools
        config.add_cleanup(pools.close)
    return pools
