"""CURVE-authenticated ZeroMQ sockets for KV transfer, made as the control plane makes its own.

The prefill side serves (ROUTER, CURVE server, a ZAP handler that admits exactly the decode side's
public key); the decode side connects (DEALER, CURVE client that knows the server's public key).
Both key pairs come from the deployment's `TransferKey`. libzmq runs the handshakes on its I/O
thread with a timeout, so a peer without the key never gets a byte decoded and never blocks anyone.
"""
from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from moe_runtime.security.closing_context import ClosingContext
from moe_runtime.security.socket_guard import OnlyKey, apply_liveness
from moe_runtime.security.transfer_key import TransferKey

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "moe-kv"
HEARTBEAT_TIMEOUT_MS = 10_000   # a pull waits on a silent peer this long (the control plane allows 20 s)
MAX_REQUEST_BYTES = 64 * 2**10     # what a KV server accepts in one frame (requests are small headers)
MAX_REPLY_FRAME_BYTES = 256 * 2**20  # what a decode rank accepts in one frame of blocks


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


class CurveServer:
    """A ROUTER bound to a free port of `host`, admitting only holders of `key`; `endpoint` says where."""

    def __init__(self, key: TransferKey, host: str):
        self.context = ClosingContext()
        self._authenticator = ThreadAuthenticator(self.context, log=logger.getChild("zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, OnlyKey(key.client_pair().public))
        pair = key.server_pair()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.curve_server = True
        self.socket.curve_publickey = pair.public
        self.socket.curve_secretkey = pair.secret
        self.socket.zap_domain = ZAP_DOMAIN.encode()
        apply_liveness(self.socket, MAX_REQUEST_BYTES, HEARTBEAT_TIMEOUT_MS)
        port = self.socket.bind_to_random_port(tcp_endpoint(host, "*")[: -len(":*")])
        self.endpoint = tcp_endpoint(host, port)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._authenticator.stop()
        self.context.term()


def curve_client(context: zmq.Context, key: TransferKey, endpoint: str,
                 monitor_events: int = 0) -> tuple[zmq.Socket, zmq.Socket | None]:
    """A DEALER connected (and reconnecting, by libzmq) to a KV server of this deployment at `endpoint`, and a
    monitor of `monitor_events` on it (None without events), watching from before the connection starts."""
    pair = key.client_pair()
    socket = context.socket(zmq.DEALER)
    socket.curve_serverkey = key.server_pair().public
    socket.curve_publickey = pair.public
    socket.curve_secretkey = pair.secret
    apply_liveness(socket, MAX_REPLY_FRAME_BYTES, HEARTBEAT_TIMEOUT_MS)
    monitor = socket.get_monitor_socket(monitor_events) if monitor_events else None
    socket.connect(endpoint)
    return socket, monitor
