"""Releases between fronts: the decode front tells the prefill front a request's parked blocks may go.

The prefill front decides when its ranks free parked blocks (they must free them at the same
lock-step boundary, so it broadcasts the release as a command); it learns that the decode side is
done from a `ReleaseKV` on its listener, or gives up at the transfer timeout. A release is
fire-and-forget: if one is lost (the prefill instance restarted, the network dropped it), the
timeout frees the blocks anyway.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

import msgspec
import zmq

from moe_runtime.security.closing_context import ClosingContext
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import KVCodec, ReleaseKV
from moe_runtime.disaggregation.kv_transfer.sockets import CurveServer, curve_client

logger = logging.getLogger(__name__)

POLL_MS = 100
MAX_CONNECTIONS = 64


class ReleaseListener:
    """The prefill front's socket for releases; `on_release(request_id)` runs on its thread for each."""

    def __init__(self, key: TransferKey, host: str, on_release: Callable[[str], None]):
        self.on_release = on_release
        self.codec = KVCodec()
        self._server = CurveServer(key, host)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="kv-release-listener", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    def _listen(self) -> None:
        socket = self._server.socket
        while not self._stop.is_set():
            if not socket.poll(POLL_MS):
                continue
            frames = socket.recv_multipart()
            try:
                message = self.codec.decode_to_server(frames[-1]) if len(frames) == 2 else None
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("KV release listener: dropped an undecodable message: %s", exc)
                continue
            if isinstance(message, ReleaseKV):
                self.on_release(message.request_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()


class ReleaseSender:
    """The decode front's end: one connection per prefill front it heard of (a bounded few)."""

    def __init__(self, key: TransferKey):
        self.key = key
        self.codec = KVCodec()
        self._context = ClosingContext()
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._lock = threading.Lock()   # a refused admission releases from a worker thread; the loop from its own
        self._closed = False

    def send(self, endpoint: str, request_id: str) -> None:
        with self._lock:
            if not self._closed:   # shut down: the prefill's timeout frees it
                self._send(endpoint, request_id)

    def _send(self, endpoint: str, request_id: str) -> None:
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket, _ = curve_client(self._context, self.key, endpoint)
            self._sockets[endpoint] = socket
            while len(self._sockets) > MAX_CONNECTIONS:
                self._sockets.popitem(last=False)[1].close(linger=0)
        self._sockets.move_to_end(endpoint)
        try:
            socket.send(self.codec.encode(ReleaseKV(request_id=request_id)), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV release of %s to %s not sent (queue full); its timeout frees it", request_id, endpoint)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for socket in self._sockets.values():
                socket.close(linger=200)   # a release sent just before shutdown still leaves
            self._sockets.clear()
            self._context.term()
