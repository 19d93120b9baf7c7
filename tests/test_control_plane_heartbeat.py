"""The control plane's heartbeat timeout is a setting ($MOE_RUNTIME_CONTROL_HEARTBEAT_TIMEOUT, default 20 s) that
reaches both ends' sockets: a peer that goes silent with its connection still open (a cut link sends no FIN) is
found gone once it has been silent that long, on each end."""
from __future__ import annotations

import logging
import select
import socket
import threading
import time

import pytest

from moe_runtime.security.control_key import ControlKey
from moe_runtime.attention_dp.control_plane import (HEARTBEAT_TIMEOUT_ENV, HEARTBEAT_TIMEOUT_MS, ControlAddress,
                                                    FrontControl, RankDisconnected, WorkerControl,
                                                    heartbeat_timeout_from_env)
from moe_runtime.security.socket_guard import HEARTBEAT_INTERVAL_MS
from moe_runtime.attention_dp.messages import Hello, WorkerSetup
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.errors import InvalidRequestError
from moe_runtime.server.cli import build_parser, engine_config_from_args


class SilencingRelay:
    """A TCP relay between a rank and the front that can go silent: it stops passing bytes on but keeps both
    connections open, as a cut link does."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silent = threading.Event()
        self.stop = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        pairs: dict[socket.socket, socket.socket] = {}
        while not self.stop.is_set():
            readable, _, _ = select.select([self.listener, *pairs], [], [], 0.05)
            for sock in readable:
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    pairs[client], pairs[upstream] = upstream, client
                    self.sockets += [client, upstream]
                elif not self.silent.is_set():
                    data = sock.recv(65536)
                    if data:
                        pairs[sock].sendall(data)
            if self.silent.is_set():
                time.sleep(0.05)   # nothing passes, nothing closes

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.sockets:
            sock.close()


def _setup() -> WorkerSetup:
    return WorkerSetup(config=EngineConfig(model="unused"), world_size=1, rendezvous="file:///unused",
                       master_addr="127.0.0.1", master_port=0, num_threads=1, log_level=logging.INFO,
                       loopback_only=True)


def test_a_silent_peer_is_found_gone_on_both_ends_after_the_configured_timeout(monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "1")
    timeout_ms = heartbeat_timeout_from_env()
    front = FrontControl(ControlAddress.tcp("127.0.0.1", 0, ControlKey.generate(), timeout_ms), _setup())
    relay = SilencingRelay(front.address.port)
    joined: dict[str, WorkerControl] = {}
    via_relay = ControlAddress.tcp("127.0.0.1", relay.port, front.address.key, timeout_ms)
    thread = threading.Thread(target=lambda: joined.setdefault(
        "rank", WorkerControl(via_relay, Hello(rank=0, pid=0, host="test"), connect_timeout_s=10)))
    try:
        thread.start()
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            assert front.receive(0.1) is None
        thread.join()
        rank = joined["rank"]
        relay.silent.set()
        silenced = time.monotonic()
        # found within a heartbeat interval plus the timeout (the 20 s default would still be waiting)
        limit_s = (HEARTBEAT_INTERVAL_MS + timeout_ms) / 1000 + 2.0
        with pytest.raises(RankDisconnected):
            while time.monotonic() - silenced < limit_s:
                front.receive(0.1)
        front_found_s = time.monotonic() - silenced
        with pytest.raises(EOFError):
            rank.get(limit_s)
        rank_found_s = time.monotonic() - silenced
        assert 0.9 <= front_found_s < limit_s and rank_found_s < limit_s, (front_found_s, rank_found_s)
        rank.close()
    finally:
        relay.close()
        front.close()


@pytest.mark.parametrize("value, expected_ms", [(None, HEARTBEAT_TIMEOUT_MS), ("", HEARTBEAT_TIMEOUT_MS),
                                                ("3", 3000), ("2.5", 2500), (" 0.25 ", 250)])
def test_the_heartbeat_timeout_is_read_in_seconds_with_a_20_s_default(value, expected_ms, monkeypatch):
    if value is None:
        monkeypatch.delenv(HEARTBEAT_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, value)
    assert heartbeat_timeout_from_env() == expected_ms
    assert HEARTBEAT_TIMEOUT_MS == 20_000


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_heartbeat_timeout_that_is_no_positive_number_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, value)
    with pytest.raises(InvalidRequestError, match=HEARTBEAT_TIMEOUT_ENV):
        heartbeat_timeout_from_env()


def test_the_flag_overrides_the_environment_and_is_refused_unless_positive(monkeypatch):
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "7")
    assert EngineConfig(model="m").control_heartbeat_timeout_ms(heartbeat_timeout_from_env) == 7000
    assert EngineConfig(model="m", control_heartbeat_timeout_s=2.5).control_heartbeat_timeout_ms(
        heartbeat_timeout_from_env) == 2500
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidRequestError, match="--control-heartbeat-timeout"):
            EngineConfig(model="m", control_heartbeat_timeout_s=bad).validate()


def test_moe_serve_takes_the_flag():
    args = build_parser().parse_args(["--control-heartbeat-timeout", "4"])
    assert engine_config_from_args(args).control_heartbeat_timeout_s == 4.0
