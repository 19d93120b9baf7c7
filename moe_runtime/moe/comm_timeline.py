"""Per-phase timestamps of every dispatch and combine, and how much of their time compute hid.

For each transfer the MoE seam notes when its start was called and returned, when the transfer
completed (`Pending.when_done`, from the communication thread) and when the wait was called and
returned. From those, per transfer:

    in flight  = completed - start returned          (0 for a backend that finished in the start)
    blocked    = the part of the wait before completion
    hidden     = in flight - blocked                  (the transfer ran while this rank computed)
    comm time  = (start returned - start called) + in flight

and the hidden share = sum(hidden) / sum(comm time). The start's own time counts as exposed comm
time (it holds the synchronous counts exchange and the packing, which the synchronous path spends
too); the wait's post-processing after completion (unpacking, grouping) is compute and counted in
neither. Without overlap every transfer is complete when its start returns: the share is 0.

Only benchmarks turn it on (`MoEExecutor.trace_comm`): a callback per transfer is cheap but not free.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from moe_runtime.dispatch.pending import Pending


@dataclass
class TransferTimes:
    """One dispatch or combine, in `time.perf_counter()` seconds."""

    kind: str                   # "dispatch" | "combine"
    start_called: float
    start_returned: float = 0.0
    completed: float | None = None   # set from the communication thread
    wait_called: float = 0.0
    wait_returned: float = 0.0

    @property
    def in_flight(self) -> float:
        done = self.completed if self.completed is not None else self.wait_returned
        return max(done - self.start_returned, 0.0)

    @property
    def blocked(self) -> float:
        done = self.completed if self.completed is not None else self.wait_returned
        return min(max(done - self.wait_called, 0.0), self.wait_returned - self.wait_called)

    @property
    def hidden(self) -> float:
        return max(self.in_flight - self.blocked, 0.0)

    @property
    def comm(self) -> float:
        return (self.start_returned - self.start_called) + self.in_flight

    @property
    def exposed(self) -> float:
        return self.comm - self.hidden


@dataclass
class CommSummary:
    """Totals over the recorded transfers of one kind (or all)."""

    transfers: int
    comm_seconds: float      # start + in flight, summed
    hidden_seconds: float    # in flight while this rank computed
    exposed_seconds: float   # comm - hidden: what the step waited for

    @property
    def hidden_share(self) -> float:
        return self.hidden_seconds / self.comm_seconds if self.comm_seconds > 0 else 0.0


@dataclass
class CommTimeline:
    """The transfers recorded since the last `clear`, in the order they were started."""

    transfers: list[TransferTimes] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def started(self, kind: str, start_called: float, pending: Pending) -> TransferTimes:
        """Note a start that has just returned `pending`; the caller fills in the wait times."""
        times = TransferTimes(kind, start_called, start_returned=time.perf_counter())
        with self._lock:
            self.transfers.append(times)
        registering = [True]   # a callback made while registering: complete when the start returned (a Ready)

        def completed() -> None:
            times.completed = times.start_returned if registering[0] else time.perf_counter()

        pending.when_done(completed)
        registering[0] = False
        return times

    def blocking(self, kind: str, called: float, returned: float) -> TransferTimes:
        """Note a transfer done in one blocking call (`ModularMoE.__call__`): nothing in flight, nothing hidden."""
        times = TransferTimes(kind, called, start_returned=returned, completed=returned, wait_called=returned,
                              wait_returned=returned)
        with self._lock:
            self.transfers.append(times)
        return times

    def clear(self) -> None:
        with self._lock:
            self.transfers = []

    def summary(self, kind: str | None = None) -> CommSummary:
        with self._lock:
            chosen = [t for t in self.transfers if kind in (None, t.kind)]
        return CommSummary(len(chosen), sum(t.comm for t in chosen), sum(t.hidden for t in chosen),
                           sum(t.exposed for t in chosen))
