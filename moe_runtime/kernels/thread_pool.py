"""One intra-op thread pool per rank, sized to the cores the rank may use and kept to them: decided here only.

Every parallel CPU loop of a step runs in torch's intra-op pool: ATen's operators, inductor's generated loops
(an AOT library's `#pragma omp parallel num_threads(n)`, the count it was compiled with: execution/aot_step.py
keys its cache on it) and the compiled expert kernels, which split their work with `at::parallel_for`
(kernels/cpu_native/expert_mlp.cpp) and so have no threads of their own. What made more threads than cores:

- the pool's default size is the machine's core count, not the cores this process may run on (a container's
  cpuset, `taskset`, a launcher splitting the machine between local ranks): the size here is
  `len(os.sched_getaffinity(0))`, divided between the host's ranks;
- torch's inter-op pool (`torch.jit.fork`, which no step uses) starts as many threads again: 1 here;
- a rank's threads could wander onto another rank's cores: each launched rank's process is kept to its own
  share (`sched_setaffinity` on each of its threads; the pool's threads, started later, inherit it). OpenMP's
  own per-thread binding (OMP_PROC_BIND / OMP_PLACES) is read when libgomp loads, which for a rank is in the
  launcher's forkserver, before the rank is known: it is not used.

Launched ranks apply their plan at start (processes/worker.py; the launcher sizes them with `for_rank` too). An
in-process engine (`LLM`, the HTTP server's engine thread) applies none: torch's default pool there is already
one thread per core of the process's affinity (libgomp counts the affinity mask), and a count the caller set
is theirs to keep. The front's threads do no parallel tensor work, so the engine's thread is the only one
entering the pool (OpenMP gives each native thread that opens a parallel region its own team: a second thread
running torch ops in parallel would be a second pool).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def available_cores() -> list[int]:
    """The CPUs this process may run on (all of them where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class ThreadPlan:
    """The cores one rank runs on and its intra-op pool's size (one thread per core)."""

    cores: tuple[int, ...]       # where the rank's threads may run
    threads: int                 # its intra-op pool
    pin: bool = False            # keep the process's threads to `cores` (a rank sharing the host with others)

    @classmethod
    def for_rank(cls, local_rank: int = 0, local_ranks: int = 1, cores: list[int] | None = None) -> "ThreadPlan":
        """Rank `local_rank` of `local_ranks` on this host: its contiguous share of the available cores, pinned
        there (all of them, unpinned, when it is alone). With fewer cores than ranks each rank gets one thread,
        unpinned: the cores are shared, not split."""
        cores = available_cores() if cores is None else sorted(cores)
        if local_ranks <= 1:
            return cls(tuple(cores), len(cores))
        if len(cores) < local_ranks:
            return cls(tuple(cores), 1)
        share = len(cores) // local_ranks
        mine = tuple(cores[local_rank * share:(local_rank + 1) * share])
        return cls(mine, len(mine), pin=True)

    def apply(self) -> bool:
        """Size torch's pools (and pin, when `pin`) in this process; False when they already were (a second engine
        in the process changes nothing). The inter-op pool can only be sized before its first use: after that
        it is left as it is."""
        changed = torch.get_num_threads() != self.threads
        if changed:
            torch.set_num_threads(self.threads)
        if torch.get_num_interop_threads() != 1:
            try:
                torch.set_num_interop_threads(1)
                changed = True
            except RuntimeError:   # already started: it stays as it is, idle (no step forks)
                pass
        if self.pin and hasattr(os, "sched_setaffinity") and set(available_cores()) != set(self.cores):
            for task in os.listdir("/proc/self/task"):   # every thread of the process, the pool's included
                try:
                    os.sched_setaffinity(int(task), self.cores)
                except OSError:   # a thread that just ended
                    pass
            changed = True
        if changed:
            logger.info("intra-op pool: %d threads on cores %s%s", self.threads, list(self.cores),
                        " (pinned)" if self.pin else "")
        return changed
