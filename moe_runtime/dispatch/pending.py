"""A dispatch or combine that may still be in flight: the two-phase (start / wait) form of the contract.

    pending = dispatcher.dispatch_start(x, slot_ids, weights)   # the transfer is on its way
    ...                                                         # compute something else meanwhile
    out = pending.wait()                                        # the DispatchOutput

Why a separate type rather than a flag on `dispatch`: a caller that overlaps (two-batch overlap) must
hold the transfer across its own compute and decide when to block, and a backend that cannot overlap
must still hand it something to hold. `Ready` is that something: the result, already there. So the
caller's code is one, whatever the backend (`Dispatcher.supports_async()` only says whether waiting
can ever find the transfer unfinished).

`InFlight` wraps a torch.distributed `Work` started with `async_op=True` (gloo runs it on its own
threads, NCCL on its stream) and keeps the tensors it reads and writes alive until it is waited on.
`then` chains the backend's post-processing (unpacking rows, grouping them by expert), which runs
in `wait`, after the transfer, on the caller's thread.
"""

from __future__ import annotations

import abc
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Pending(abc.ABC, Generic[T]):
    """A result that may need a transfer to finish first. Wait once; the result is kept."""

    @abc.abstractmethod
    def wait(self) -> T:
        """Block until the transfer is complete, then return the result (the same object every call)."""

    @abc.abstractmethod
    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the transfer has completed: at once if it already has, else later, possibly
        on a communication thread (so it must only take a timestamp or set a flag). For per-phase timings."""

    def then(self, finish: Callable[[T], U]) -> "Pending[U]":
        """A pending whose result is `finish(this result)`, computed in its `wait`."""
        return _Then(self, finish)


class Ready(Pending[T]):
    """A result with nothing in flight: what a backend that cannot overlap returns from its `*_start`."""

    def __init__(self, value: T):
        self._value = value

    def wait(self) -> T:
        return self._value

    def when_done(self, callback: Callable[[], None]) -> None:
        callback()


class InFlight(Pending[T]):
    """One collective started with `async_op=True`; `result` is read once `work` has completed."""

    def __init__(self, work, result: Callable[[], T], keep_alive: tuple = ()):
        self._work = work
        self._result = result
        self._keep_alive = keep_alive   # send/receive buffers the collective still uses
        self._done = False
        self._value: T | None = None
        self._seen_in_wait: list[Callable[[], None]] = []   # callbacks of a Work without a future

    def wait(self) -> T:
        if not self._done:
            self._work.wait()
            for callback in self._seen_in_wait:
                callback()
            self._value = self._result()
            self._done, self._keep_alive, self._seen_in_wait = True, (), []
        return self._value

    def when_done(self, callback: Callable[[], None]) -> None:
        if self._done:
            callback()
            return
        try:
            future = self._work.get_future()
        except (RuntimeError, AttributeError):  # a backend without futures: completion is seen in wait
            self._seen_in_wait.append(callback)
            return
        future.then(lambda _: callback())


class _Then(Pending[U]):
    def __init__(self, inner: Pending[T], finish: Callable[[T], U]):
        self._inner = inner
        self._finish = finish
        self._done = False
        self._value: U | None = None

    def wait(self) -> U:
        if not self._done:
            self._value = self._finish(self._inner.wait())
            self._done = True
        return self._value

    def when_done(self, callback: Callable[[], None]) -> None:
        self._inner.when_done(callback)
