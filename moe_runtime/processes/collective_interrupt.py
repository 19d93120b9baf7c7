"""Breaking a rank out of a collective its job can no longer finish.

A rank blocked in a gloo collective with a peer that is gone without closing its connections (a cut link, a
hung node) waits out the group timeout: nothing in torch.distributed interrupts it, and its main thread cannot
read the front's `Reform` meanwhile. The front therefore sends its own ranks `INTERRUPT_SIGNAL` before it
re-forms them; a watcher thread of the rank (the only thread that takes the signal: every other blocks it, and
one that did not would take the default action, the end of the process) shuts the rank's side of its TCP
connections, so its pending collective fails at once and the rank reports and waits for the `Reform`. Peers on
other nodes then fail in turn, their connections to it closed.

The watcher says when it has handled an interrupt (`settle`): the rank waits for that before it joins the new
groups, so a late watcher cannot shut the new job's connections.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading

logger = logging.getLogger(__name__)

INTERRUPT_SIGNAL = signal.SIGUSR1
SETTLE_TIMEOUT_S = 10.0


def block_interrupt_signal() -> None:
    """In the rank's first thread, before any other starts (threads inherit the mask)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {INTERRUPT_SIGNAL})


class CollectiveInterrupt:
    def __init__(self, keep_ports: frozenset[int]):
        self.keep_ports = keep_ports          # the front's control connection across nodes stays
        self._handled = threading.Event()
        threading.Thread(target=self._watch, name="collective-interrupt", daemon=True).start()

    def _watch(self) -> None:
        while True:
            signal.sigwait({INTERRUPT_SIGNAL})
            shut = shut_tcp_connections(self.keep_ports)
            logger.warning("interrupted by the front: %d connections of the broken job shut", shut)
            self._handled.set()

    def settle(self) -> None:
        """Wait until the interrupt the front sent (before its `Reform`) has been handled."""
        if not self._handled.wait(SETTLE_TIMEOUT_S):
            logger.warning("the front's interrupt was not seen within %.0f s", SETTLE_TIMEOUT_S)
        self._handled.clear()


def shut_tcp_connections(keep_ports: frozenset[int]) -> int:
    """Shut down this process's connected TCP sockets but those to `keep_ports`; how many. On a worker rank
    these are gloo's pairs and its TCP store client (one node: the control plane is an IPC socket)."""
    shut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))   # family and type read from the descriptor
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                if sock.getpeername()[1] not in keep_ports:
                    sock.shutdown(socket.SHUT_RDWR)   # the descriptor gloo holds shares this socket
                    shut += 1
        except OSError:   # a listening or unconnected socket
            pass
        finally:
            sock.close()
    return shut
