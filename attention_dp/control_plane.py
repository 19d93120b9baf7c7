"""The control plane between the front process and the worker ranks: one TCP connection per rank.

Requests, aborts and other commands go out to every rank; outputs, stats and failures come back.
TCP (not in-process queues) so that ranks on other nodes, started by `moe-serve --node-rank N` or
by torchrun, join the same way as the ranks the front spawns itself. Tensors never travel here:
activations and expert traffic use torch.distributed.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait

DEFAULT_AUTHKEY_ENV = "MOE_RUNTIME_CONTROL_KEY"


@dataclass(frozen=True)
class ControlAddress:
    host: str
    port: int
    authkey: bytes

    @classmethod
    def shared_key(cls) -> bytes:
        """The key ranks on other nodes must share: $MOE_RUNTIME_CONTROL_KEY, else a fixed default."""
        return os.environ.get(DEFAULT_AUTHKEY_ENV, "moe-runtime-control").encode()


@dataclass
class Hello:
    """A rank's first message: who it is."""

    rank: int
    pid: int
    host: str


@dataclass
class WorkerSetup:
    """The front's answer to Hello: everything a rank needs to build its share of the engine."""

    config: object          # EngineConfig
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int
    log_level: int


class RankDisconnected(Exception):
    def __init__(self, rank: int):
        super().__init__(f"worker rank {rank} disconnected")
        self.rank = rank


class FrontControl:
    """Listens for ranks, answers their Hello with the setup, then broadcasts and receives."""

    def __init__(self, host: str, port: int, authkey: bytes, setup: WorkerSetup):
        self.listener = Listener((host, port), authkey=authkey)
        self.address = ControlAddress(host, self.listener.address[1], authkey)
        self.setup = setup
        self.connections: dict[int, Connection] = {}
        self.hellos: dict[int, Hello] = {}
        self._arrivals: queue.Queue = queue.Queue()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="control-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                connection = self.listener.accept()
                hello = connection.recv()
                connection.send(self.setup)
            except (OSError, EOFError):
                if self._closed:
                    return
                continue
            self._arrivals.put((hello, connection))

    def collect_arrivals(self) -> list[int]:
        """Register ranks that connected since the last call; returns their ranks."""
        arrived = []
        while True:
            try:
                hello, connection = self._arrivals.get_nowait()
            except queue.Empty:
                return arrived
            self.connections[hello.rank] = connection
            self.hellos[hello.rank] = hello
            arrived.append(hello.rank)

    def broadcast(self, message) -> None:
        for rank, connection in self.connections.items():
            try:
                connection.send(message)
            except OSError as exc:
                raise RankDisconnected(rank) from exc

    def receive(self, timeout: float):
        """(rank, message) from any rank, or None after `timeout`; RankDisconnected on EOF."""
        ready = wait(list(self.connections.values()), timeout)
        if not ready:
            return None
        connection = ready[0]
        rank = next(r for r, c in self.connections.items() if c is connection)
        try:
            return rank, connection.recv()
        except (EOFError, OSError) as exc:
            raise RankDisconnected(rank) from exc

    def close(self) -> None:
        self._closed = True
        for connection in self.connections.values():
            connection.close()
        self.listener.close()


class WorkerControl:
    """A rank's end: queue-like `get` / `get_nowait` for commands, `put` for results."""

    def __init__(self, address: ControlAddress, hello: Hello, connect_timeout_s: float = 600.0):
        self.connection = self._connect(address, connect_timeout_s)
        self.connection.send(hello)
        self.setup: WorkerSetup = self.connection.recv()

    @staticmethod
    def _connect(address: ControlAddress, timeout_s: float) -> Connection:
        """Ranks on other nodes may start before the front listens: retry until it does."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return Client((address.host, address.port), authkey=address.authkey)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def get(self, timeout: float | None = None):
        if timeout is not None and not self.connection.poll(timeout):
            raise queue.Empty
        return self.connection.recv()  # EOFError when the front is gone: the rank exits

    def get_nowait(self):
        return self.get(timeout=0)

    def put(self, message) -> None:
        self.connection.send(message)

    def close(self) -> None:
        self.connection.close()
