"""A decode rank's KV puller: fetches an imported request's blocks from the prefill ranks into its cache.

One thread per rank works through the imports in order. For each it asks every prefill rank of
its plan (`plan.plan_pulls`) for pieces of at most `MAX_PIECE_BYTES` (one layer, some blocks), a
few in flight per rank, and writes each reply into the blocks the engine allocated for the import,
which no running sequence uses yet. Replies are checked (the piece asked for, the exact byte count
of each frame) before a byte is written. The engine learns the outcome from `take_landed` (and
an `on_landed` wake-up); a cancelled import (aborted, timed out) is written no further: the check
and each write hold the same lock, so after `cancel` returns its blocks are the engine's again.

Failing fast: a prefill rank whose connection closes under a pull, or that cannot be reached
(`UNREACHABLE_RETRIES` reconnection attempts), fails the import at once rather than at the timeout.
A rank that does not hold the request (yet) is asked again for `NOT_PARKED_GRACE_S`: the prefill
front hands out the handle when the worker's reporting rank has parked the blocks, and its other
ranks park them in the same step, but may be a moment behind.

A hybrid model's import also pulls the request's recurrent states (`PullJob.state_sources`, cut into
`state_pieces.StatePiece`s) into its state slot, on the same connections, checked and written the same way.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from moe_runtime.disaggregation.kv_transfer.cache_io import from_frame, write_blocks
from moe_runtime.security.closing_context import ClosingContext
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import KVCodec, PullBlocks, PullStates
from moe_runtime.disaggregation.kv_transfer.plan import PullSource
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.sockets import curve_client
from moe_runtime.disaggregation.kv_transfer.state_pieces import StatePiece, parse_states, state_pieces_of
from moe_runtime.disaggregation.kv_transfer.state_plan import StatePullSource
from moe_runtime.layers.kv_cache import LayerKVCache

logger = logging.getLogger(__name__)

MAX_PIECE_BYTES = 4 * 2**20   # one reply: large enough to stream at memory speed, small enough to bound memory
WINDOW = 4                    # pieces in flight per prefill rank
POLL_MS = 20
UNREACHABLE_RETRIES = 10      # libzmq retries a refused connection every 100 ms: about 1 s
NOT_PARKED_GRACE_S = 2.0      # how long a prefill rank may not hold the request yet
RETRY_PAUSE_S = 0.01          # before asking such a rank again
MAX_CONNECTIONS = 64          # prefill ranks kept connected (least recently used closed first)
MONITORED_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class PullFailed(RuntimeError):
    """This import's pull cannot complete; the message says why (it becomes the request's error)."""


@dataclass
class PullJob:
    request_id: str                 # on this (decode) instance
    source_request_id: str          # on the prefill instance
    block_ids: list[int]            # this rank's blocks for the request, in order (at least the prompt's)
    num_tokens: int                 # tokens whose KV is pulled (the prompt)
    sources: list[PullSource]
    timeout_s: float
    cancelled: bool = False
    state_sources: list[StatePullSource] = field(default_factory=list)   # hybrid models' linear layers
    state_slot: int = -1            # this rank's recurrent-state slot for the request (with state_sources)


@dataclass(frozen=True)
class PullResult:
    request_id: str
    error: str | None               # None: every block landed
    num_bytes: int
    seconds: float
    recomputable: bool = True       # after an error: computing the prompt on the decode side gives the request its
                                    # KV (a transfer that failed); False where that would fail alike (its grammar)


@dataclass(frozen=True)
class Piece:
    source: PullSource
    layer: int
    first_block: int
    num_blocks: int


@dataclass
class Connection:
    socket: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    retries: int = 0
    pending: deque = field(default_factory=deque)   # pieces not sent yet
    in_flight: int = 0
    resume_at: float = 0.0                          # time.monotonic() before which nothing is sent


def pieces_of(job: PullJob, block_size: int) -> list[Piece]:
    """The pulls that fetch `job`: per source and layer, its blocks in runs of at most MAX_PIECE_BYTES."""
    num_blocks = math.ceil(job.num_tokens / block_size)
    pieces = []
    for source in job.sources:
        per_block = source.shard.bytes_per_block(source.num_heads)
        step = max(1, MAX_PIECE_BYTES // max(per_block, 1))
        for layer in range(source.first_layer, source.first_layer + source.num_layers):
            for first in range(0, num_blocks, step):
                pieces.append(Piece(source, layer, first, min(step, num_blocks - first)))
    return pieces


class KVPuller:
    def __init__(self, caches: list[LayerKVCache], local: KVShard, key: TransferKey,
                 on_landed: Callable[[], None] | None = None):
        self.caches = caches
        self.local = local
        self.key = key
        self.on_landed = on_landed
        self.codec = KVCodec()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._by_id: dict[str, PullJob] = {}
        self._landed: deque[PullResult] = deque()
        self._lock = threading.Lock()          # guards writes into the cache against cancel, and the tables
        self._pull_ids = 0
        self._context = ClosingContext()
        self._connections: OrderedDict[str, Connection] = OrderedDict()   # puller thread only
        self._thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self._thread.start()

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._by_id[job.request_id] = job
        self._jobs.put(job)

    def cancel(self, request_id: str) -> None:
        """Write nothing more for `request_id` (its blocks are the caller's once this returns); no result comes."""
        with self._lock:
            job = self._by_id.pop(request_id, None)
            if job is not None:
                job.cancelled = True

    def take_landed(self) -> list[PullResult]:
        with self._lock:
            results, self._landed = list(self._landed), deque()
        return results

    def close(self) -> None:
        with self._lock:
            for job in self._by_id.values():
                job.cancelled = True
        self._jobs.put(None)
        self._thread.join(timeout=5)
        for connection in self._connections.values():
            self._close(connection)
        self._context.term()

    # ---- the puller thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:
                continue
            started = time.perf_counter()
            num_bytes, error = 0, None
            try:
                num_bytes = self._pull(job)
            except PullFailed as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - this import fails, the puller goes on
                logger.exception("KV pull of %s failed", job.request_id)
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if job.cancelled or self._by_id.pop(job.request_id, None) is None:
                    continue
                self._landed.append(PullResult(job.request_id, error, num_bytes, time.perf_counter() - started))
            if self.on_landed is not None:
                self.on_landed()

    def _pull(self, job: PullJob) -> int:
        """Fetch and write every piece of `job`; the bytes received. Raises `PullFailed`."""
        started = time.monotonic()
        deadline = started + job.timeout_s
        if len(job.block_ids) < math.ceil(job.num_tokens / self.local.block_size):
            raise PullFailed(f"{len(job.block_ids)} blocks allocated for {job.num_tokens} tokens")
        if job.state_sources and job.state_slot < 0:
            raise PullFailed("the request has no recurrent-state slot to pull its states into")
        connections: dict[str, Connection] = {}
        for piece in [*pieces_of(job, self.local.block_size), *state_pieces_of(job.state_sources, MAX_PIECE_BYTES)]:
            endpoint = piece.source.shard.endpoint
            if endpoint not in connections:
                connections[endpoint] = self._connection(endpoint)
            connections[endpoint].pending.append(piece)
        owners: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()
        for endpoint, connection in connections.items():
            for socket in (connection.socket, connection.monitor):
                poller.register(socket, zmq.POLLIN)
                owners[socket] = endpoint
        outstanding: dict[int, tuple[str, Piece]] = {}   # pull id -> (endpoint, piece)
        num_bytes = 0
        try:
            while True:
                now = time.monotonic()
                for endpoint, connection in connections.items():
                    while connection.pending and connection.in_flight < WINDOW and now >= connection.resume_at:
                        piece = connection.pending.popleft()
                        outstanding[self._send(connection, piece, job)] = (endpoint, piece)
                        connection.in_flight += 1
                if not outstanding and not any(c.pending for c in connections.values()):
                    return num_bytes
                if job.cancelled:
                    raise PullFailed("cancelled")
                if time.monotonic() > deadline:
                    raise PullFailed(f"the prefill instance did not deliver the KV blocks within {job.timeout_s:g}s")
                for socket, _ in poller.poll(POLL_MS):
                    endpoint = owners[socket]
                    connection = connections[endpoint]
                    if socket is connection.monitor:
                        waiting = bool(connection.pending) or any(e == endpoint for e, _ in outstanding.values())
                        self._watch(connection, endpoint, waiting)
                    else:
                        num_bytes += self._receive(connection, endpoint, outstanding, job,
                                                   retry=time.monotonic() - started < NOT_PARKED_GRACE_S)
        finally:
            for connection in connections.values():
                connection.pending.clear()
                connection.in_flight = 0

    def _send(self, connection: Connection, piece: Piece | StatePiece, job: PullJob) -> int:
        self._pull_ids += 1
        source = piece.source
        if isinstance(piece, StatePiece):
            connection.socket.send(self.codec.encode(PullStates(request_id=job.source_request_id,
                                                                pull_id=self._pull_ids, layers=piece.layers)))
            return self._pull_ids
        connection.socket.send(self.codec.encode(PullBlocks(
            request_id=job.source_request_id, pull_id=self._pull_ids, first_layer=piece.layer, num_layers=1,
            head_start=source.head_start, num_heads=source.num_heads, first_block=piece.first_block,
            num_blocks=piece.num_blocks)))
        return self._pull_ids

    def _receive(self, connection: Connection, endpoint: str, outstanding: dict, job: PullJob, retry: bool) -> int:
        """Check one reply and write its blocks; the bytes it carried (0 for a stale reply). With `retry`, a piece
        the rank does not hold the request for is asked for again shortly."""
        frames = connection.socket.recv_multipart(copy=False)
        try:
            reply = self.codec.decode_reply(frames[0].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PullFailed(f"the prefill rank at {endpoint} sent an undecodable reply: {exc}") from exc
        entry = outstanding.get(reply.pull_id)
        if entry is None or entry[0] != endpoint:
            return 0   # the answer to a pull of an import that already failed
        piece = outstanding.pop(reply.pull_id)[1]
        connection.in_flight -= 1
        if reply.not_parked and retry:
            connection.pending.appendleft(piece)
            connection.resume_at = time.monotonic() + RETRY_PAUSE_S
            return 0
        if reply.error:
            raise PullFailed(f"the prefill rank at {endpoint} refused: {reply.error}")
        if isinstance(piece, StatePiece):
            return self._write_states(piece, frames[1:], endpoint, job)
        shard = piece.source.shard
        dims = shard.dims_of(piece.layer)
        if len(frames) != 1 + len(dims):
            raise PullFailed(f"the prefill rank at {endpoint} sent {len(frames) - 1} frames, not {len(dims)}")
        element = torch.tensor([], dtype=shard.torch_dtype).element_size()
        parts, num_bytes = [], 0
        for frame, dim in zip(frames[1:], dims):
            shape = (piece.num_blocks, shard.rows_per_block(piece.layer), piece.source.num_heads, dim)
            expected = math.prod(shape) * element
            if frame.buffer.nbytes != expected:
                raise PullFailed(f"the prefill rank at {endpoint} sent {frame.buffer.nbytes} bytes, not {expected}")
            parts.append(from_frame(frame.buffer, shard.torch_dtype, shape))
            num_bytes += expected
        ids = torch.tensor(job.block_ids[piece.first_block : piece.first_block + piece.num_blocks], dtype=torch.long)
        head = piece.source.head_start - self.local.head_start
        with self._lock:
            if job.cancelled:
                raise PullFailed("cancelled")
            write_blocks(self.caches[piece.layer - self.local.first_layer], ids,
                         slice(head, head + piece.source.num_heads), parts)
        return num_bytes

    def _write_states(self, piece: StatePiece, frames: list, endpoint: str, job: PullJob) -> int:
        """Check one reply of recurrent states and write them into the request's slot; the bytes it carried."""
        try:
            states, num_bytes = parse_states(self.local, piece, frames)
        except ValueError as exc:
            raise PullFailed(f"the prefill rank at {endpoint} sent states of another shape: {exc}") from exc
        with self._lock:
            if job.cancelled:
                raise PullFailed("cancelled")
            for layer, parts in zip(piece.layers, states):
                self.caches[layer - self.local.first_layer].write_slot(job.state_slot, parts)
        return num_bytes

    def _watch(self, connection: Connection, endpoint: str, waiting: bool) -> None:
        """Follow one connection event; fail the pull when its prefill rank is gone or refuses us."""
        event = recv_monitor_message(connection.monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            connection.connected, connection.retries = True, 0
        elif event == zmq.EVENT_DISCONNECTED:
            was_connected, connection.connected = connection.connected, False
            if was_connected and waiting:
                raise PullFailed(f"the prefill rank at {endpoint} closed the connection during the transfer "
                                 f"(its instance stopped?)")
        elif event == zmq.EVENT_CONNECT_RETRIED:
            connection.retries += 1
            if not connection.connected and connection.retries >= UNREACHABLE_RETRIES and waiting:
                raise PullFailed(f"the prefill rank at {endpoint} cannot be reached (its instance stopped?)")
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL) and waiting:
            raise PullFailed(f"the prefill rank at {endpoint} refused the handshake (another deployment's "
                             f"--kv-transfer-key?)")

    def _connection(self, endpoint: str) -> Connection:
        connection = self._connections.get(endpoint)
        if connection is not None:
            self._connections.move_to_end(endpoint)
            return connection
        socket, monitor = curve_client(self._context, self.key, endpoint, MONITORED_EVENTS)
        connection = self._connections[endpoint] = Connection(socket, monitor)
        while len(self._connections) > MAX_CONNECTIONS:
            self._close(self._connections.popitem(last=False)[1])
        return connection

    @staticmethod
    def _close(connection: Connection) -> None:
        connection.socket.disable_monitor()
        connection.monitor.close(linger=0)
        connection.socket.close(linger=0)
