"""`DeadlineTimer`: one asyncio timer at the earliest of some deadlines, armed again as they change.

A P/D instance's front has deadlines (a parked export freed at its timeout, an import settled at its own); one
loop timer at the earliest of them replaces a periodic tick. Before a loop is attached it does nothing: the
blocking driver checks the deadlines at every `step()`."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass
class DeadlineTimer:
    callback: Callable[[], None]
    loop: asyncio.AbstractEventLoop | None = None
    _handle: asyncio.TimerHandle | None = None

    def arm(self, deadlines: Iterable[float | None]) -> None:
        """Fire `callback` on the loop at the earliest of `deadlines` (time.monotonic(); None: no deadline), unless
        an earlier firing is already due."""
        pending = [deadline for deadline in deadlines if deadline is not None]
        if self.loop is None or not pending:
            return
        when = self.loop.time() + max(min(pending) - time.monotonic(), 0.0)
        if self._handle is not None:
            if self._handle.when() <= when:
                return
            self._handle.cancel()
        self._handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self.callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
