"""The control plane as an attacker meets it: no pickle, no entry without the key, no stall.

Each attempt is one that ran code in, or stalled, the front of the old control plane (pickle
over `multiprocessing.connection`, a public default key, an accept thread that a silent or
garbage connection blocked or killed).
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import re
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from moe_runtime.security.control_key import CONTROL_KEY_ENV, ControlKey, ControlKeyError
from moe_runtime.attention_dp.control_plane import ControlAddress, FrontControl, RankDisconnected, WorkerControl, Woken
from moe_runtime.attention_dp.messages import Hello, MessageCodec, ResetPrefixCache, Shutdown, WorkerSetup
from moe_runtime import LLM, SamplingParams
from moe_runtime.security.transfer_key import KV_KEY_ENV, TransferKey, TransferKeyError
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.processes.distributed import free_ports
from moe_runtime.server.cli import main as moe_serve_main
from moe_runtime.config.engine_config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_runtime", "attention_dp", "dispatch", "kernels", "load_balancer", "server")


class CreatesFileWhenUnpickled:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def _setup(world_size: int = 2) -> WorkerSetup:
    return WorkerSetup(config=EngineConfig(model="unused"), world_size=world_size, rendezvous="file:///unused",
                       master_addr="127.0.0.1", master_port=0, num_threads=1, log_level=logging.INFO,
                       loopback_only=True)


@pytest.fixture
def front():
    control = FrontControl(ControlAddress.tcp("127.0.0.1", 0, ControlKey.generate()), _setup())
    yield control
    control.close()


def _join(address: ControlAddress, rank: int, timeout_s: float = 10.0) -> WorkerControl:
    return WorkerControl(address, Hello(rank=rank, pid=0, host="test"), connect_timeout_s=timeout_s)


def _join_in_background(front: FrontControl, address: ControlAddress, rank: int,
                        hello_queued_first: bool = False) -> WorkerControl:
    """A rank joins while the front's thread serves its socket (as the launcher's start-up loop does); with
    `hello_queued_first` the front starts reading only once the rank's Hello has had time to arrive (a busy front)."""
    joined: dict[str, WorkerControl] = {}
    thread = threading.Thread(target=lambda: joined.setdefault("rank", _join(address, rank)))
    thread.start()
    if hello_queued_first:
        time.sleep(1.0)
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        assert front.receive(0.1) is None
    thread.join()
    assert "rank" in joined, f"rank {rank} did not join"
    return joined["rank"]


def test_a_command_sent_to_some_ranks_reaches_only_them(front):
    ranks = [_join_in_background(front, front.address, rank) for rank in (0, 1)]
    front.send(ResetPrefixCache(), {1})
    assert isinstance(ranks[1].get(5), ResetPrefixCache)
    with pytest.raises(queue.Empty):
        ranks[0].get(0.3)
    for rank in ranks:
        rank.close()


def test_a_wake_ends_a_ranks_wait_at_once_and_is_no_command(front):
    """A KV pull that ends wakes a waiting rank (its lock-step loop reports it) instead of a 5 ms poll."""
    rank = _join_in_background(front, front.address, rank=0)
    threading.Timer(0.2, rank.wake).start()
    started = time.monotonic()
    assert isinstance(rank.get(), Woken)
    assert time.monotonic() - started < 2
    front.broadcast(Shutdown())
    assert isinstance(rank.get(5), Shutdown), "the wake left nothing behind"
    rank.close()


def test_pickle_sent_to_the_control_port_runs_nothing(front, tmp_path):
    """Raw bytes from a stranger never reach a decoder; from a holder of the key they fail to decode."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(CreatesFileWhenUnpickled(marker))
    with socket.create_connection(("127.0.0.1", front.address.port)) as stranger:
        stranger.sendall(payload)
        assert front.receive(0.5) is None
    insider = _join_in_background(front, front.address, rank=0)
    insider._socket.send(payload)
    insider._socket.send(msgspec.msgpack.encode({"type": "Evil", "rank": 0}))
    assert front.receive(0.5) is None, "an undecodable message must be dropped, not delivered"
    assert not marker.exists(), "the payload was unpickled"
    insider.close()


def test_garbage_and_silent_connections_do_not_stop_ranks_joining(front):
    silent = socket.create_connection(("127.0.0.1", front.address.port))
    garbage = socket.create_connection(("127.0.0.1", front.address.port))
    garbage.sendall(b"\xff" * 4096 + b"GET / HTTP/1.1\r\n\r\n")
    assert front.receive(0.3) is None
    started = time.monotonic()
    ranks = [_join_in_background(front, front.address, rank) for rank in (0, 1)]
    assert time.monotonic() - started < 10
    assert sorted(front.hellos) == [0, 1]
    front.broadcast(Shutdown())
    assert all(isinstance(rank.get(5), Shutdown) for rank in ranks)
    for s in (silent, garbage, *ranks):
        s.close()


def test_a_rank_with_the_wrong_key_never_joins(front):
    wrong = ControlAddress.tcp("127.0.0.1", front.address.port, ControlKey.generate())
    with pytest.raises(TimeoutError, match="same control key"):
        _join(wrong, rank=0, timeout_s=1.0)
    assert front.receive(0.2) is None and front.hellos == {}


def test_hello_claiming_another_rank_or_out_of_range_is_refused(front):
    codec = MessageCodec()
    context = zmq.Context()
    impostor = context.socket(zmq.DEALER)
    rank_pair = front.address.key.rank_pair()
    impostor.setsockopt(zmq.ROUTING_ID, b"rank-1")
    impostor.curve_serverkey = front.address.key.front_pair().public
    impostor.curve_publickey, impostor.curve_secretkey = rank_pair.public, rank_pair.secret
    impostor.connect(front.address.endpoint)
    impostor.send(codec.encode(Hello(rank=0, pid=0, host="x")))    # routing id says rank 1
    impostor.send(codec.encode(Hello(rank=99, pid=0, host="x")))   # no such rank
    assert front.receive(1.0) is None and front.hellos == {}
    impostor.close(linger=0)
    context.term()


def test_disconnects_are_seen_on_both_ends(front):
    rank = _join_in_background(front, front.address, rank=1)
    rank.close()
    with pytest.raises(RankDisconnected) as lost:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            front.receive(0.1)
    assert lost.value.rank == 1
    survivor = _join_in_background(front, front.address, rank=0)
    front.close()
    with pytest.raises(EOFError):
        survivor.get(10)
    survivor.close()


def test_a_rank_reads_the_shutdown_sent_right_before_the_front_closes():
    """A rank the front did not start (torchrun, another node) must see Shutdown, not only the disconnect:
    the front waits for every rank to leave, and a rank reads pending messages before the disconnect."""
    front = FrontControl(ControlAddress.tcp("127.0.0.1", 0, ControlKey.generate()), _setup(world_size=1))
    rank = _join_in_background(front, front.address, rank=0)
    front.broadcast(Shutdown())
    left = threading.Thread(target=front.wait_for_ranks_to_leave, args=(10.0,))
    left.start()
    time.sleep(0.5)  # the Shutdown and (once the front closes) the disconnect are both waiting for the rank
    assert left.is_alive(), "the front stopped waiting before the rank left"
    assert isinstance(rank.get(10), Shutdown)
    rank.close()
    left.join(10)
    assert not left.is_alive(), "the front did not see the rank leave"
    front.close()


def test_a_rank_reads_what_arrived_before_the_disconnect():
    front = FrontControl(ControlAddress.tcp("127.0.0.1", 0, ControlKey.generate()), _setup(world_size=1))
    rank = _join_in_background(front, front.address, rank=0)
    front.broadcast(Shutdown())
    time.sleep(0.5)  # delivered to the rank's queue, unread
    front.close()
    time.sleep(0.5)  # the disconnect is seen too
    assert isinstance(rank.get(10), Shutdown)
    with pytest.raises(EOFError):
        rank.get(10)
    rank.close()


def test_multi_node_and_external_worker_jobs_refuse_to_start_without_a_key(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(CONTROL_KEY_ENV, raising=False)
    with pytest.raises(ControlKeyError, match=CONTROL_KEY_ENV):
        ControlKey.shared()
    with pytest.raises(SystemExit) as exited:
        moe_serve_main(["--external-workers", "--ep", "2"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert CONTROL_KEY_ENV in error and "--control-key-file" in error
    short = tmp_path / "short.key"
    short.write_text("secret")
    short.chmod(0o600)
    with pytest.raises(ControlKeyError, match="at least 32"):
        ControlKey.shared(str(short))
    good = tmp_path / "good.key"
    strong = secrets.token_hex(32)
    good.write_text(strong + "\n")
    good.chmod(0o600)
    assert ControlKey.shared(str(good)).secret == strong.encode()
    assert strong[:8] not in repr(ControlKey.shared(str(good)))


WEAK_KEYS = {
    "sixteen equal bytes": "aaaaaaaaaaaaaaaa",
    "64 equal characters": "a" * 64,
    "40 hex digits (20 bytes)": secrets.token_hex(20),
    "a 16-character pattern twice": "abcdefghijklmnop" * 2,
    "64 hex digits of an 8-byte pattern": "0123456789abcdef" * 4,
    "31 random characters": secrets.token_urlsafe(32)[:31],
}
SHARED_KEYS = [(ControlKey.shared, CONTROL_KEY_ENV, ControlKeyError),
               (TransferKey.shared, KV_KEY_ENV, TransferKeyError)]


@pytest.mark.parametrize("load, env, error", SHARED_KEYS, ids=["control key", "kv key"])
@pytest.mark.parametrize("weak", WEAK_KEYS.values(), ids=WEAK_KEYS)
def test_a_guessable_key_is_refused(load, env, error, weak, monkeypatch, tmp_path):
    """`aaaaaaaaaaaaaaaa` once keyed a job: a peer that guessed it claimed a rank and read the setup."""
    monkeypatch.setenv(env, weak)
    with pytest.raises(error, match="32 random bytes"):
        load()
    key_file = tmp_path / "weak.key"
    key_file.write_text(weak + "\n")
    key_file.chmod(0o600)
    with pytest.raises(error, match="32 random bytes"):
        load(str(key_file))


@pytest.mark.parametrize("load, env, error", SHARED_KEYS, ids=["control key", "kv key"])
def test_random_keys_are_accepted_in_every_spelling(load, env, error, monkeypatch):
    for strong in (secrets.token_hex(32), secrets.token_urlsafe(32)):
        monkeypatch.setenv(env, strong)
        assert load() is not None
    assert ControlKey(secrets.token_bytes(32)) and TransferKey.from_secret(secrets.token_bytes(32))


@pytest.mark.parametrize("load, env, error", SHARED_KEYS, ids=["control key", "kv key"])
def test_a_key_file_other_users_can_read_is_refused(load, env, error, tmp_path):
    key_file = tmp_path / "shared.key"
    key_file.write_text(secrets.token_hex(32))
    for mode in (0o644, 0o640, 0o604):
        key_file.chmod(mode)
        with pytest.raises(error) as refused:
            load(str(key_file))
        assert str(key_file) in str(refused.value) and f"chmod 600 {key_file}" in str(refused.value)
    key_file.chmod(0o600)
    assert load(str(key_file)) is not None


def test_a_peer_holding_the_control_key_learns_no_kv_secret(tiny_checkpoint_factory, monkeypatch):
    """One secret never travels inside a message another protects: a peer that claims a rank of a P/D job
    gets its `WorkerSetup`, which carries no KV transfer secret (ranks read it as the front does)."""
    kv_secret = secrets.token_hex(32)
    monkeypatch.setenv(CONTROL_KEY_ENV, secrets.token_hex(32))
    monkeypatch.setenv(KV_KEY_ENV, kv_secret)
    master_port, control_port = free_ports(2)
    config = EngineConfig(model=str(tiny_checkpoint_factory("mixtral")), device="cpu", ep=2, dp_attn=2,
                          launch_workers=False, master_port=master_port, control_port=control_port,
                          disaggregation_mode="prefill")
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            make_engine(config, startup_timeout_s=20).shutdown()
        except BaseException as exc:  # noqa: BLE001 - the start-up is meant to fail: no real ranks come
            outcome.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    impostor = _join(ControlAddress.tcp("127.0.0.1", control_port, ControlKey.shared()), rank=1, timeout_s=20)
    encoded = MessageCodec().encode(impostor.setup)
    impostor.close()
    starting.join(30)
    assert not starting.is_alive() and outcome, "the start-up should end when the claimed rank leaves"
    assert impostor.setup.config.disaggregation_mode == "prefill"
    assert kv_secret.encode() not in encoded and bytes.fromhex(kv_secret) not in encoded


def _connections_accepted_on(port: int) -> int:
    """How many established TCP connections this process holds whose local end is `port` (the accepted ones)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED
                inodes.add(fields[9])
    held = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", str(fd.readlink()))
        except OSError:
            continue
        held += bool(match and match.group(1) in inodes)
    return held


def test_a_flood_of_half_open_connections_is_capped_and_logged_once(front, caplog):
    """1,100 silent connections once took every descriptor of the front (HTTP stalled 9 s): the control port
    holds only a few handshakes per peer and overall, closes the rest at once, and says so once."""
    port = front.address.port
    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        with caplog.at_level(logging.WARNING, logger="attention_dp"):
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                assert front.receive(0.1) is None
        held = _connections_accepted_on(port)
        assert held <= 32, f"the front holds {held} of the flood's 300 connections"
        flood_lines = [r for r in caplog.records if "control port" in r.getMessage()]
        assert 1 <= len(flood_lines) <= 2, [r.getMessage() for r in flood_lines]
        assert not any(r.exc_info for r in caplog.records)
    finally:
        for sock in flood:
            sock.close()
    ranks = [_join_in_background(front, front.address, rank) for rank in (0, 1)]   # the flood is over: ranks join
    assert sorted(front.hellos) == [0, 1]
    for rank in ranks:
        rank.close()


def test_a_stale_disconnect_of_a_closed_connection_does_not_end_the_rank_that_reuses_its_descriptor(front):
    """Messages are read before connection events, so the closing of earlier connections can still be queued when
    a Hello arrives over a new connection that took over one of their descriptors (seen in CI: a rank joining right
    after a flood was ended by the flood's stale disconnect). The front applies the queued events first."""
    # 24 connections from another process (so only the front's descriptors are freed here), from three addresses
    # to stay under the cap of 10 per address; the joining rank's own new descriptors take fewer than 24
    connections = ("import socket, sys\n"
                   f"held = [socket.create_connection(('127.0.0.1', {front.address.port}), "
                   "source_address=(f'127.0.0.{s}', 0)) for s in (2, 3, 4) for _ in range(8)]\n"
                   "print('open', flush=True); sys.stdin.read()\n")
    earlier = subprocess.Popen([sys.executable, "-c", connections], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert earlier.stdout.readline() == "open\n"
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert front.receive(0.1) is None   # accepted and counted
    earlier.stdin.close()
    earlier.wait(timeout=10)
    time.sleep(0.5)   # their disconnects are queued, their descriptors free; nobody reads the events yet
    rank = _join_in_background(front, front.address, 0, hello_queued_first=True)
    try:
        assert front.receive(0.5) is None   # no RankDisconnected for rank 0
        assert front.ranks == [0]
    finally:
        rank.close()


def test_the_cap_holds_while_the_loop_serves_the_control_socket(front):
    """Serving, the front's loop watches the socket's events (`wait_for_disconnect`): the same cap applies."""
    port = front.address.port

    async def flood_while_serving() -> int:
        front.attach_to_loop()
        watcher = asyncio.ensure_future(front.wait_for_disconnect())
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        try:
            await asyncio.sleep(1.5)
            return _connections_accepted_on(port)
        finally:
            watcher.cancel()
            front.detach_from_loop()
            for sock in flood:
                sock.close()

    held = asyncio.run(flood_while_serving())
    assert held <= 32, f"the front holds {held} of the flood's 300 connections"


@pytest.mark.slow
def test_http_stays_responsive_while_the_control_port_is_flooded(tiny_checkpoint_factory):
    """`moe-serve --external-workers` (its TCP control port open, waiting for ranks) with 256 descriptors in all:
    300 silent connections to the control port once took them all (HTTP stalled 8 s, 38,000 tracebacks in the
    log); now HTTP answers at once and the flood is one log line."""
    http_port, master_port, control_port = free_ports(3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{CONTROL_KEY_ENV: secrets.token_hex(32)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    server = subprocess.Popen(
        [sys.executable, "-m", "moe_runtime.server.cli", "--model", str(tiny_checkpoint_factory("mixtral")), "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(http_port), "--ep", "2", "--dp-attn", "2", "--external-workers",
         "--master-port", str(master_port), "--control-port", str(control_port)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    health = f"http://127.0.0.1:{http_port}/health"
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not any("started 0 of 2 worker ranks" in line for line in log):   # the control port listens
            assert time.monotonic() < deadline and server.poll() is None, "".join(log)
            time.sleep(0.2)
        before = len(log)
        flood = [socket.create_connection(("127.0.0.1", control_port), timeout=5) for _ in range(300)]
        time.sleep(1.0)
        for _ in range(5):
            started = time.monotonic()
            assert httpx.get(health, timeout=10).status_code == 503   # still starting: no rank has come
            assert time.monotonic() - started < 2.0, f"/health took {time.monotonic() - started:.1f}s"
        flood_log = log[before:]
        assert not any("Traceback" in line for line in flood_log), "".join(flood_log[:20])
        assert sum("control port" in line for line in flood_log) == 1 and len(flood_log) <= 5, "".join(flood_log)
    finally:
        for sock in flood:
            sock.close()
        # killed, not terminated: a server still waiting for its ranks finishes starting before SIGTERM stops it
        # (moe_runtime/server/engine_launch.py), which here is never; it started no rank that could outlive it
        server.kill()
        server.wait(20)


def _listening_sockets(pids: set[int]) -> list[str]:
    """'address:port' of every listening TCP socket that one of `pids` holds (from /proc)."""
    inodes: dict[str, str] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                inodes[fields[9]] = fields[1]
    found = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            match = re.fullmatch(r"socket:\[(\d+)\]", target)
            if match and match.group(1) in inodes:
                found.append(inodes[match.group(1)])
    return found


def _is_loopback(hex_address: str) -> bool:
    address = hex_address.split(":")[0]
    if len(address) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return address.endswith("7F")
    return address == "00000000000000000000000001000000"  # ::1


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32", ep=2, dp_attn=2) as llm:
        yield llm


def test_a_single_node_job_listens_on_loopback_only(two_ranks):
    pids = {p.pid for p in two_ranks.engine.client.processes.values()} | {os.getpid()}
    listening = _listening_sockets(pids)
    assert listening, "expected the ranks' gloo sockets"
    control = two_ranks.engine.client.control.address.endpoint
    assert control.startswith("ipc://"), f"one node: the control socket is a unix socket, not {control}"
    private = Path(control.removeprefix("ipc://")).parent
    assert private.stat().st_mode & 0o077 == 0, "the job's directory must be private to its user"
    exposed = [address for address in listening if not _is_loopback(address)]
    assert not exposed, f"sockets beyond loopback: {exposed}"
    assert two_ranks.expert_load() is not None  # the load report crosses the control plane as lists


def test_control_plane_bytes_per_token_do_not_grow_with_the_output(two_ranks):
    """Ranks send each step's new tokens only (never the prompt, earlier tokens or text)."""
    traffic = two_ranks.engine.client.control.traffic
    prompt = list(range(3, 40))

    def bytes_per_token(new_tokens: int) -> float:
        before = traffic.bytes_received
        [output] = two_ranks.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                              ignore_eos=True))
        assert len(output.token_ids) == new_tokens
        return (traffic.bytes_received - before) / new_tokens

    short, long = bytes_per_token(16), bytes_per_token(256)
    assert long <= short * 1.05, f"{long:.1f} bytes/token at 256 tokens vs {short:.1f} at 16"


def test_a_prompt_goes_only_to_the_ranks_of_its_worker(two_ranks):
    """The other DP worker's rank gets a fixed-size `AdmittedElsewhere` in its place: it steps with the
    request but never decodes its prompt (at 64 ranks, 1x the prompt's bytes on the wire instead of 64x)."""
    engine = two_ranks.engine
    traffic = engine.client.control.traffic
    prompt = [100 + (7 * i) % 150 for i in range(480)]          # two msgpack bytes per token id
    prompt_bytes = len(msgspec.msgpack.encode(prompt))
    before = traffic.bytes_sent
    engine.add_request("one-worker", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    sent = traffic.bytes_sent - before
    assert prompt_bytes <= sent < 1.5 * prompt_bytes, f"{sent} bytes sent for a prompt of {prompt_bytes}"
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [len(o.token_ids) for o in finished] == [2]


def test_no_pickle_in_the_packages():
    """No deserializer that builds arbitrary objects, anywhere a socket could feed it."""
    forbidden = re.compile(r"^\s*(import pickle|from pickle|import dill|from multiprocessing\.connection|"
                           r"import cloudpickle)|torch\.load\(|pickle\.loads|"
                           r"(all_)?gather_object|broadcast_object_list|scatter_object_list", re.MULTILINE)
    offenders = [str(path.relative_to(REPO_ROOT)) for package in PACKAGES
                 for path in (REPO_ROOT / package).rglob("*.py") if forbidden.search(path.read_text())]
    assert offenders == []
