"""The control plane as an attacker meets it: no pickle, no entry without the key, no stall.

Each attempt is one that ran code in, or stalled, the front of the old control plane (pickle
over `multiprocessing.connection`, a public default key, an accept thread that a silent or
garbage connection blocked or killed).
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import re
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from attention_dp.control_key import CONTROL_KEY_ENV, ControlKey, ControlKeyError
from attention_dp.control_plane import ControlAddress, FrontControl, RankDisconnected, WorkerControl, Woken
from attention_dp.messages import Hello, MessageCodec, ResetPrefixCache, Shutdown, WorkerSetup
from moe_runtime import LLM, SamplingParams
from server.cli import main as moe_serve_main
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


def _join_in_background(front: FrontControl, address: ControlAddress, rank: int) -> WorkerControl:
    """A rank joins while the front's thread serves its socket (as the launcher's start-up loop does)."""
    joined: dict[str, WorkerControl] = {}
    thread = threading.Thread(target=lambda: joined.setdefault("rank", _join(address, rank)))
    thread.start()
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
    with pytest.raises(ControlKeyError, match="at least 16"):
        ControlKey.shared(str(short))
    good = tmp_path / "good.key"
    good.write_text("0123456789abcdef0123\n")
    assert ControlKey.shared(str(good)).secret == b"0123456789abcdef0123"
    assert "0123" not in repr(ControlKey.shared(str(good)))


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
