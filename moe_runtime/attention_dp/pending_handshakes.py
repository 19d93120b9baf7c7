"""A cap on the control port's connections that have not proven the key yet.

libzmq accepts every TCP connection at once and holds a descriptor for it until its CURVE handshake succeeds or
times out (`HANDSHAKE_TIMEOUT_MS`): 1,100 silent connections once took every descriptor of the front, so HTTP
could accept nothing for 9 s. libzmq has no option that limits accepted connections (its handshake deadline and
message size bound are set: `security/socket_guard.apply_liveness`), so the front watches its socket's events instead:
an accepted connection (its descriptor) is pending until its rank says Hello or it closes, and one beyond the
caps (per peer address, and overall) is shut down at once, which makes libzmq close it and free its descriptor.
Refusals are logged once per interval, as counts, never once per connection.

A descriptor is acted on only while it is still a TCP connection to the control port (libzmq may have closed
it, and the number been reused, before its event is read).
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class HandshakeCaps:
    per_peer: int   # pending connections from one address
    overall: int    # pending connections in all

    @classmethod
    def for_job(cls, world_size: int) -> "HandshakeCaps":
        """Room for every rank to connect from one address at once (torchrun on one node), and for reconnects."""
        return cls(per_peer=world_size + 8, overall=2 * world_size + 64)


@dataclass
class RefusalLog:
    """Refusals since the last warning; a warning at the first, then at most one per interval."""

    interval_s: float = REFUSAL_LOG_INTERVAL_S
    refused: int = 0
    peers: set[str] = field(default_factory=set)
    last_logged: float | None = None

    def refused_one(self, peer: str, now: float, port: int, caps: HandshakeCaps) -> None:
        self.refused += 1
        self.peers.add(peer)
        if self.last_logged is not None and now - self.last_logged < self.interval_s:
            return
        logger.warning("control port %d: closing connections beyond the cap of those that have not completed the "
                       "key handshake (%d per address, %d in all): %d closed since the last such line, from %s; "
                       "a flood of connections, or ranks of another job? (at most one such line per %.0fs)",
                       port, caps.per_peer, caps.overall, self.refused,
                       ", ".join(sorted(self.peers)[:8]) + (" and others" if len(self.peers) > 8 else ""),
                       self.interval_s)
        self.refused, self.peers, self.last_logged = 0, set(), now


@dataclass
class PendingHandshakes:
    """The control port's accepted connections that no rank has said Hello on, by descriptor."""

    port: int
    caps: HandshakeCaps
    expire_s: float               # libzmq has dropped a connection by then: a missed close event stops counting
    clock: Callable[[], float] = time.monotonic
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)   # descriptor -> (peer address, since)
    log: RefusalLog = field(default_factory=RefusalLog)

    def accepted(self, fd: int) -> None:
        now = self.clock()
        self._expire(now)
        try:
            connection = socket.socket(fileno=fd)   # borrowed: detached below, never closed here
        except OSError:
            return  # closed already and not a socket now
        try:
            if connection.family not in (socket.AF_INET, socket.AF_INET6) or connection.getsockname()[1] != self.port:
                return  # closed already and the number reused for something else
            peer = connection.getpeername()[0]
            from_peer = sum(1 for address, _ in self.pending.values() if address == peer)
            if from_peer >= self.caps.per_peer or len(self.pending) >= self.caps.overall:
                connection.shutdown(socket.SHUT_RDWR)   # libzmq reads the end of the stream and closes it
                self.log.refused_one(peer, now, self.port, self.caps)
                return
            self.pending[fd] = (peer, now)
        except OSError:
            return  # the peer is gone already
        finally:
            connection.detach()

    def ended(self, fd: int) -> None:
        """The connection said Hello (a rank) or closed."""
        self.pending.pop(fd, None)

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, (_, since) in self.pending.items() if now - since > self.expire_s]:
            del self.pending[fd]
