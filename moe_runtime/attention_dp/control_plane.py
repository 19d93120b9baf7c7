"""The control plane between the front process and the worker ranks, on ZeroMQ.

The front binds one ROUTER socket; each rank connects one DEALER socket (routing id = its rank).
Requests, aborts and other commands go out to every rank; outputs, stats and failures come back.
A socket (not in-process queues) so that ranks on other nodes, started by `moe-serve --node-rank
N` or by torchrun, join the same way as the ranks the front spawns itself. Tensors never travel
here: activations and expert traffic use torch.distributed.

Security: every connection is authenticated by the CURVE handshake (see `control_key`) before a
single byte of payload reaches this code; messages are msgpack decoded only into the types of
`attention_dp.messages`; a payload that fails to decode is logged and dropped. libzmq's I/O
thread runs the handshakes, with a timeout, so a silent or garbage connection never blocks or
kills anything here: it is simply never admitted. On a TCP control port, connections that have not said
Hello are capped per peer address and overall (`pending_handshakes`): a flood of them is closed as it
arrives instead of taking the front's descriptors, and is logged once.

Liveness: the front watches its socket's events: a rank whose connection (known by its file
descriptor, taken from its Hello) closes is reported as disconnected, and heartbeats close
connections to a peer that stopped answering (a node that lost power sends no FIN). A rank
watches its connection the same way and exits when the front is gone. How long a silent peer is waited for is
the job's heartbeat timeout: 20 s, or $MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT seconds where the front, a node's
launcher or a torchrun rank starts (`heartbeat_timeout_from_env`); it travels with the `ControlAddress`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import queue
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from moe_runtime.security.closing_context import ClosingContext
from moe_runtime.security.control_key import ControlKey
from moe_runtime.attention_dp.messages import Hello, Message, MessageCodec, WorkerSetup
from moe_runtime.attention_dp.pending_handshakes import HandshakeCaps, PendingHandshakes
from moe_runtime.errors import InvalidRequestError
from moe_runtime.security.socket_guard import HANDSHAKE_TIMEOUT_MS, OnlyKey, apply_liveness

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_MS = 20_000    # no traffic and no heartbeat answer for this long: the peer is gone (default)
HEARTBEAT_TIMEOUT_ENV = "MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT"   # seconds, overrides the default
MAX_MESSAGE_BYTES = 256 * 2**20  # an authenticated peer still cannot make the front allocate more
LAST_MESSAGE_GRACE_MS = 200       # after the front disconnects, how long a rank looks for what it sent last
ZAP_DOMAIN = "moe-control"


@dataclass(frozen=True)
class ControlAddress:
    """Where ranks connect (a ZeroMQ endpoint), and the key they prove they hold.

    One node: `ipc://` in the job's private directory (no TCP port at all). Across nodes:
    `tcp://host:port` (port 0 when binding: any free one).
    """

    endpoint: str
    key: ControlKey
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS   # both ends: a peer silent this long is gone

    @classmethod
    def tcp(cls, host: str, port: int, key: ControlKey,
            heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> "ControlAddress":
        return cls(f"tcp://{f'[{host}]' if ':' in host else host}:{port}", key, heartbeat_timeout_ms)

    @classmethod
    def ipc(cls, path: str, key: ControlKey, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> "ControlAddress":
        return cls(f"ipc://{path}", key, heartbeat_timeout_ms)

    @property
    def port(self) -> int | None:
        """The TCP port, or None for an ipc:// endpoint."""
        return int(self.endpoint.rsplit(":", 1)[1]) if self.endpoint.startswith("tcp://") else None

    def for_local_ranks(self) -> "ControlAddress":
        """What ranks on the front's own machine connect to (a wildcard bind is reached on loopback)."""
        for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:", "tcp://*:"):
            if self.endpoint.startswith(wildcard):
                return dataclasses.replace(self, endpoint=f"tcp://127.0.0.1:{self.port}")
        return self


def heartbeat_timeout_from_env() -> int:
    """The heartbeat timeout in ms: $MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT (seconds, > 0) or the 20 s default.

    Shorter finds a node whose link was cut sooner; too short for the network or the load takes a slow peer for
    a lost one (heartbeats go every 2 s, each end checks its own). Read where a job's control address is made:
    the front, another node's launcher, a rank torchrun starts; ranks a launcher spawns get it with the address."""
    raw = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "").strip()
    if not raw:
        return HEARTBEAT_TIMEOUT_MS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequestError(f"${HEARTBEAT_TIMEOUT_ENV}={raw!r}: give the control plane's heartbeat timeout in "
                         f"seconds, > 0 (default {HEARTBEAT_TIMEOUT_MS / 1000:g})")
    return max(1, round(seconds * 1000))


@dataclass
class ControlTraffic:
    """Bytes and messages the front's control socket moved (payloads, as encoded)."""

    bytes_received: int = 0
    messages_received: int = 0
    bytes_sent: int = 0


class RankDisconnected(Exception):
    def __init__(self, rank: int):
        super().__init__(f"worker rank {rank} disconnected")
        self.rank = rank


def _routing_id(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class FrontControl:
    """The front's end: answers each rank's Hello with the setup, then broadcasts and receives.

    Not thread-safe (one ZeroMQ socket): one thread at a time drives it.
    """

    def __init__(self, bind: ControlAddress, setup: WorkerSetup):
        self.setup = setup
        self.codec = MessageCodec()
        self.hellos: dict[int, Hello] = {}
        self._setups: dict[int, WorkerSetup] = {}   # a replacement rank's own setup, by rank (`readmit`)
        self._returning: set[int] = set()            # lost ranks whose Hello is awaited (`await_return`)
        self.traffic = ControlTraffic()
        self._peers: dict[bytes, int] = {}      # routing id -> rank, for ranks that said Hello
        self._rank_by_fd: dict[int, int] = {}   # their connections' file descriptors
        self._lost: list[int] = []              # ranks whose disconnect was seen while admitting a Hello
        self._context = ClosingContext()
        self._authenticator = ThreadAuthenticator(self._context, log=logger.getChild("zap"))
        self._authenticator.start()
        key = bind.key
        rank_public = key.rank_pair().public
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, OnlyKey(rank_public))
        front = key.front_pair()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.curve_server = True
        self._socket.curve_publickey = front.public
        self._socket.curve_secretkey = front.secret
        self._socket.zap_domain = ZAP_DOMAIN.encode()
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to a gone rank raises, never drops silently
        apply_liveness(self._socket, MAX_MESSAGE_BYTES, bind.heartbeat_timeout_ms)
        watched = zmq.EVENT_DISCONNECTED | (zmq.EVENT_ACCEPTED if bind.endpoint.startswith("tcp://") else 0)
        self._monitor = self._socket.get_monitor_socket(watched)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._async_socket: zmq.asyncio.Socket | None = None
        self._async_monitor: zmq.asyncio.Socket | None = None
        self._lost_signal: asyncio.Event | None = None
        if bind.port == 0:
            port = self._socket.bind_to_random_port(bind.endpoint.rsplit(":", 1)[0])
            bind = dataclasses.replace(bind, endpoint=f"{bind.endpoint.rsplit(':', 1)[0]}:{port}")
        else:
            self._socket.bind(bind.endpoint)
        self.address = bind
        self.handshakes = (PendingHandshakes(bind.port, HandshakeCaps.for_job(setup.world_size),
                                             expire_s=HANDSHAKE_TIMEOUT_MS / 1000 + 5.0)
                           if bind.port is not None else None)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._peers.values())

    def broadcast(self, message: Message) -> None:
        payload = self.codec.encode(message)
        for routing_id, rank in list(self._peers.items()):
            self._send(routing_id, rank, payload)

    def send(self, message: Message, ranks: set[int]) -> None:
        """`message` to the ranks in `ranks` only (encoded once)."""
        payload = self.codec.encode(message)
        for routing_id, rank in list(self._peers.items()):
            if rank in ranks:
                self._send(routing_id, rank, payload)

    def _send(self, routing_id: bytes, rank: int, payload: bytes) -> None:
        try:
            if self._async_socket is None:
                self._socket.send_multipart([routing_id, payload])
            else:  # through the loop's socket, which then re-checks for messages that arrived meanwhile
                sent = self._async_socket.send_multipart([routing_id, payload])
                if sent.done() and sent.exception() is not None:
                    raise sent.exception()
            self.traffic.bytes_sent += len(payload)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the rank's connection is gone
            raise RankDisconnected(rank) from exc

    # ---- event-driven use, on an asyncio loop ----------------------------------------------------
    def attach_to_loop(self) -> None:
        """From now on the running asyncio loop owns the socket: `receive_async`, and sends through it.

        The synchronous `receive` must not be used after this.
        """
        self._async_socket = zmq.asyncio.Socket.from_socket(self._socket)
        self._async_monitor = zmq.asyncio.Socket.from_socket(self._monitor)
        self._lost_signal = asyncio.Event()

    def detach_from_loop(self) -> None:
        """Back to blocking use (the loop is done with the socket, or gone): e.g. to send Shutdown.

        On the loop, the sockets' notification descriptors leave its selector now: closed later, their numbers
        can come back for a new job's sockets, which the selector would then take for the stale ones."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # not on a loop (it is gone, or this is another thread): nothing to take back
            loop = None
        for shadow in (self._async_socket, self._async_monitor):
            if shadow is not None and loop is not None and not shadow.closed:
                loop.remove_reader(shadow.FD)
        self._async_socket = None
        self._async_monitor = None
        self._lost_signal = None

    async def receive_async(self) -> tuple[int, Message]:
        """The next (rank, message), awaited on the loop; Hellos are answered on the way."""
        while True:
            received = self._admit(await self._async_socket.recv_multipart(copy=False))
            if received is not None:
                return received

    async def wait_for_disconnect(self) -> int:
        """Await the first rank whose connection closes; its rank (also one seen while a Hello was admitted)."""
        while True:
            if self._lost:
                return self._lost.pop(0)
            self._lost_signal.clear()
            event_received = asyncio.ensure_future(self._async_monitor.recv_multipart())
            lost_signalled = asyncio.ensure_future(self._lost_signal.wait())
            try:
                await asyncio.wait({event_received, lost_signalled}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost_signalled.cancel()
                if not event_received.done():
                    event_received.cancel()
            if event_received.done() and not event_received.cancelled():
                try:
                    self._forget_connection(parse_monitor_message(event_received.result()))
                except RankDisconnected as lost:
                    self._lost.append(lost.rank)

    def receive(self, timeout: float) -> tuple[int, Message] | None:
        """(rank, message) from any rank that said Hello, or None after `timeout` seconds.

        Hellos are answered here; RankDisconnected when a rank's connection closes.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self._lost:
                raise RankDisconnected(self._lost.pop(0))
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(remaining_ms))
            if not ready:
                return None
            if self._socket in ready:  # messages first: a rank's last words arrive before its disconnect
                received = self._admit(self._socket.recv_multipart(copy=False))
                if received is not None:
                    return received
            elif self._monitor in ready:
                self._watch_connections()

    def _watch_connections(self) -> None:
        self._forget_connection(recv_monitor_message(self._monitor))

    def _take_queued_events(self) -> None:
        """Apply every connection event already queued, before a Hello ties a rank to its connection's descriptor.

        Messages are read before events (a rank's last words come before its disconnect), so the closing of an
        earlier connection may still be queued when a Hello arrives over a new one that reuses its descriptor; taken
        later, that stale event would end the new rank. Disconnects of ranks found here are raised by the next
        `receive`, after the Hello has been answered.
        """
        while self._monitor.poll(0, zmq.POLLIN):
            try:
                self._watch_connections()
            except RankDisconnected as lost:
                self._lost.append(lost.rank)
                if self._lost_signal is not None:
                    self._lost_signal.set()   # on the loop: `wait_for_disconnect` takes it

    def _forget_connection(self, event: dict) -> None:
        """Count a connection the port accepted (TCP), forget one that closed; RankDisconnected if a rank's."""
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            if self.handshakes is not None and fd not in self._rank_by_fd:
                self.handshakes.accepted(fd)
            return
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        if self.handshakes is not None:
            self.handshakes.ended(fd)
        rank = self._rank_by_fd.pop(fd, None)
        if rank is not None:
            self._peers.pop(_routing_id(rank), None)
            raise RankDisconnected(rank)

    def _admit(self, frames: list[zmq.Frame]) -> tuple[int, Message] | None:
        if len(frames) != 2:
            logger.warning("control plane: dropped a message of %d frames (a rank sends one)", len(frames) - 1)
            return None
        routing_id, payload = frames[0].bytes, frames[1].bytes
        rank = self._peers.get(routing_id)
        self.traffic.bytes_received += len(payload)
        self.traffic.messages_received += 1
        try:
            message = self.codec.decode_to_front(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("control plane: dropped an undecodable message from %r: %s", routing_id, exc)
            return None
        if isinstance(message, Hello):
            self._take_queued_events()
            returned = message.rank in self._returning
            self._welcome(routing_id, message, frames[1].get(zmq.SRCFD))
            return (message.rank, message) if returned and message.rank in self.hellos else None
        if rank is None:
            logger.warning("control plane: dropped %s from %r, which has not said Hello", type(message).__name__,
                           routing_id)
            return None
        return rank, message

    def _welcome(self, routing_id: bytes, hello: Hello, fd: int) -> None:
        if not 0 <= hello.rank < self.setup.world_size or routing_id != _routing_id(hello.rank):
            logger.warning("control plane: refused Hello from %r claiming rank %d of %d", routing_id, hello.rank,
                           self.setup.world_size)
            return
        if hello.rank in self.hellos:
            logger.warning("control plane: rank %d said Hello twice (a second process with the same rank?)",
                           hello.rank)
            return
        self._peers[routing_id] = hello.rank
        self._rank_by_fd[fd] = hello.rank
        if self.handshakes is not None:
            self.handshakes.ended(fd)
        self.hellos[hello.rank] = hello
        if hello.rank in self._returning:   # answered once the others are ready to take it back (`answer`)
            self._returning.discard(hello.rank)
            return
        self._send(routing_id, hello.rank, self.codec.encode(self._setups.pop(hello.rank, self.setup)))

    def readmit(self, rank: int, setup: WorkerSetup) -> None:
        """A lost rank's replacement may say Hello as `rank` (once) and is answered with `setup`."""
        self.hellos.pop(rank, None)
        self._setups[rank] = setup

    def await_return(self, ranks: set[int]) -> None:
        """Lost ranks that may come back (a node restarted with the job's key): each may say Hello once more,
        which `receive` hands to the caller as a message, unanswered until `answer`."""
        for rank in ranks:
            self.hellos.pop(rank, None)
        self._returning |= set(ranks)

    def answer(self, rank: int, setup: WorkerSetup) -> None:
        """The setup of a rank that came back (`await_return`)."""
        self._send(_routing_id(rank), rank, self.codec.encode(setup))

    def wait_for_ranks_to_leave(self, timeout_s: float) -> None:
        """After a Shutdown: wait until every rank has closed its connection, so that no rank sees the
        front go before it has read the Shutdown (a rank the front did not start cannot be joined)."""
        deadline = time.monotonic() + timeout_s
        while self._peers and time.monotonic() < deadline:
            try:
                self.receive(deadline - time.monotonic())  # late outputs are of no use now
            except RankDisconnected:
                pass

    def close(self) -> None:
        if _close_watched(self._socket, self._monitor, linger_ms=0):
            self._authenticator.stop()
            self._context.term()


def _close_watched(socket: zmq.Socket, monitor: zmq.Socket, linger_ms: int) -> bool:
    """Close a socket and its monitor; False if it was closed already."""
    if socket.closed:
        return False
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=linger_ms)
    return True


class Woken:
    """What `WorkerControl.get` returns when `wake()` was called: a rank-local event, not a command."""


class WorkerControl:
    """A rank's end: queue-like `get` / `get_nowait` for commands, `put` for results.

    `get` raises EOFError once the front's connection is gone, so the rank exits. `wake()` (any thread)
    makes a waiting `get` return a `Woken` (a KV pull ended: the loop reports it without polling).
    """

    def __init__(self, address: ControlAddress, hello: Hello, connect_timeout_s: float = 600.0):
        self.codec = MessageCodec()
        self._context = ClosingContext()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, _routing_id(hello.rank))
        rank = address.key.rank_pair()
        self._socket.curve_serverkey = address.key.front_pair().public
        self._socket.curve_publickey = rank.public
        self._socket.curve_secretkey = rank.secret
        apply_liveness(self._socket, MAX_MESSAGE_BYTES, address.heartbeat_timeout_ms)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address.endpoint)  # retried by libzmq until the front listens
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._connected = False
        try:
            self._socket.send(self.codec.encode(hello))
            self.setup: WorkerSetup = self._first_setup(connect_timeout_s, address)
        except BaseException:
            self.close()   # no answer (or an interrupt): nothing of this end outlives the failure
            raise

    def _first_setup(self, timeout_s: float, address: ControlAddress) -> WorkerSetup:
        try:
            message = self.get(timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer from the front at {address.endpoint} within {timeout_s:.0f}s (is it "
                               f"running, and do both ends use the same control key?)") from None
        if not isinstance(message, WorkerSetup):
            raise EOFError(f"the front answered Hello with {type(message).__name__}")
        return message

    def get(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(wait_ms))
            if self._socket in ready:  # messages first: the front's Shutdown arrives before its disconnect
                return self.codec.decode_to_rank(self._socket.recv())
            if self._wake_read in ready:
                self._drain_wakes()
                return Woken()
            if self._monitor in ready:
                self._watch_connection()
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise queue.Empty

    def _watch_connection(self) -> None:
        event = recv_monitor_message(self._monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected:
            if self._socket.poll(LAST_MESSAGE_GRACE_MS, zmq.POLLIN):
                return  # what the front sent before it closed is still to be read
            raise EOFError("the front closed the control connection")

    def get_nowait(self) -> Message:
        return self.get(timeout=0)

    def wake(self) -> None:
        """Thread-safe: the next (or a waiting) `get` returns a `Woken`."""
        os.write(self._wake_write, b"w")

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def put(self, message: Message) -> None:
        self._socket.send(self.codec.encode(message))

    def flush(self, timeout_s: float) -> None:
        """Close, waiting up to `timeout_s` for queued messages to be sent (a rank's last words)."""
        if _close_watched(self._socket, self._monitor, linger_ms=int(timeout_s * 1000)):
            self._context.term()  # returns once the queue is sent or the linger expired

    def close(self) -> None:
        self.flush(0)
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)
