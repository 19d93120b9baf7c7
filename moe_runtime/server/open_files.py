"""`moe-serve` and its file descriptors: a flood of connections must neither leave HTTP unable to accept nor
fill the log.

- At start the soft RLIMIT_NOFILE goes up to the hard limit (the soft default is often 1,024 while the hard one
  is 512k or more): headroom for HTTP, the engine's sockets and the ranks this process spawns, which inherit it.
  The control port caps the connections it holds before their handshake (`attention_dp.pending_handshakes`).
- If accept() still fails for want of descriptors, asyncio logs a traceback for every connection it tries in
  that pass, up to the listen backlog (2,048) each second: 26,433 tracebacks in 9 s. `AcceptFailureLog` lets
  one line a minute through, with the count of the others.
"""
from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

ACCEPT_FAILURE = "socket.accept() out of system resource"   # asyncio's message (selector_events)
ACCEPT_FAILURE_LOG_INTERVAL_S = 60.0


def raise_open_file_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft   # unlimited hard limits cannot be the soft one on every system: leave it
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.info("open-file limit stays at %d (raising it to %d failed: %s)", soft, hard, exc)
        return soft
    return hard


@dataclass(eq=False)
class AcceptFailureLog(logging.Filter):
    """A filter on the `asyncio` logger: the first "accept() out of system resource" of each interval goes
    through as one line without its traceback, saying how many were dropped since; other records pass."""

    interval_s: float = ACCEPT_FAILURE_LOG_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    dropped: int = 0
    last_logged: float | None = field(default=None)

    def __post_init__(self) -> None:
        super().__init__()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(ACCEPT_FAILURE):
            return True
        now = self.clock()
        if self.last_logged is not None and now - self.last_logged < self.interval_s:
            self.dropped += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = ("HTTP cannot accept connections: %s (open-file limit %d); they wait in the listen backlog. "
                      "%d such failures since the last such line (at most one per %.0fs)")
        record.args = (error or "out of resources", resource.getrlimit(resource.RLIMIT_NOFILE)[0], self.dropped,
                       self.interval_s)
        record.exc_info, record.exc_text = None, None
        self.dropped, self.last_logged = 0, now
        return True

    @classmethod
    def install(cls, target: logging.Logger) -> None:
        """Once per logger (serving again in the same process adds no second filter)."""
        if not any(isinstance(existing, cls) for existing in target.filters):
            target.addFilter(cls())
