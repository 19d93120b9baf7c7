"""What every CURVE-secured ZeroMQ socket of the runtime sets (the control plane's and the KV transfer's).

`apply_liveness`: no lingering on close, a CURVE handshake deadline, heartbeats that find a vanished peer, and a
bound on what one message may make this end allocate; `OnlyKey`: the ZAP check that admits exactly one public key.
"""
from __future__ import annotations

import hmac

import zmq

HANDSHAKE_TIMEOUT_MS = 10_000    # a connection that has not completed CURVE by then is dropped
HEARTBEAT_INTERVAL_MS = 2_000


def apply_liveness(socket: zmq.Socket, max_message_bytes: int, heartbeat_timeout_ms: int) -> None:
    """Each socket passes its own message bound and how long a silent peer may stay."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


class OnlyKey:
    """ZAP credentials check: admit exactly the peer's public key."""

    def __init__(self, public_z85: bytes):
        self.public_z85 = public_z85

    def callback(self, domain: str, client_key_z85: bytes) -> bool:
        return hmac.compare_digest(client_key_z85, self.public_z85)
