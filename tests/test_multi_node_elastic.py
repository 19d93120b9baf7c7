"""A two-node job in two network namespaces joined by a veth pair (its addresses exist inside them only): node 1's
ranks are killed, or its link is cut (taken down, or dropping every packet), and node 0's ranks re-form without
them when they still hold a slot for every expert, or the engine ends naming why not; a link losing some packets is
ridden through. Root and iproute2 (and nftables, for the loss) are needed; where the machine refuses network
namespaces (or nftables) the tests say so and skip."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_runtime.security.control_key import CONTROL_KEY_ENV
from moe_runtime.attention_dp.control_plane import HEARTBEAT_TIMEOUT_ENV
from network_namespaces import TwoNodes, packet_loss_unavailable, unavailable
from moe_runtime.processes.distributed import free_ports

NAMESPACES_REFUSED = unavailable()   # why this machine cannot make two network namespaces (None: it can)
LOSS_REFUSED = packet_loss_unavailable() if NAMESPACES_REFUSED is None else None   # ... or drop packets in them
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NAMESPACES_REFUSED is not None, reason=str(NAMESPACES_REFUSED))]

DRIVER = Path(__file__).with_name("multi_node_driver.py")
WAIT_S = 240
# Both nodes find the other's silence after 4 s instead of the default 20 (heartbeats go every 2 s; 5% packet loss,
# which TCP resends within a second, is still ridden through).
HEARTBEAT_TIMEOUT_S = "4"


@pytest.fixture
def two_nodes():
    nodes = TwoNodes.create(os.getpid() % 200 + 10)
    yield nodes
    nodes.remove()


def _env(interface: str) -> dict:
    tests = str(Path(__file__).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=interface)
    env[HEARTBEAT_TIMEOUT_ENV] = HEARTBEAT_TIMEOUT_S
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), tests, env.get("PYTHONPATH")]))
    return env


def _run(nodes: TwoNodes, checkpoint: Path, out: Path, redundant: int, take_away, bring_back=None,
         take_away_again=None) -> dict:
    """Node 0 (the front and ranks 0-1) and node 1 (`moe-serve --node-rank 1`: ranks 2-3); after the first
    answers, `take_away(node1)`; returns what node 0 wrote after that (after.json or dead.json), and with
    `bring_back(node1, start_node1)` (which starts node 1 again) what it wrote once node 1's ranks were back (back.json),
    or with `take_away_again()` what it wrote after that (again.json)."""
    master_port, control_port = free_ports(2)
    key = secrets.token_hex(32)
    addr = nodes.first.address
    node0 = nodes.run_in(nodes.first, [sys.executable, str(DRIVER), str(checkpoint), str(out), addr, str(master_port),
                                        str(control_port), str(redundant)],
                         env={**_env(nodes.first.interface), CONTROL_KEY_ENV: key})

    def start_node1() -> subprocess.Popen:
        return nodes.run_in(nodes.second, [sys.executable, "-m", "moe_runtime.server.cli", "--model", str(checkpoint), "--device",
                                           "cpu", "--ep", "4", "--dp-attn", "4", "--nnodes", "2", "--node-rank", "1",
                                           "--master-addr", addr, "--master-port", str(master_port), "--control-port",
                                           str(control_port), "--num-redundant-experts", str(redundant),
                                           "--log-level", "warning"],
                            env={**_env(nodes.second.interface), CONTROL_KEY_ENV: key}, start_new_session=True)

    node1s = [start_node1()]
    try:
        before = _await_outcome(out, ("before.json",), node0, node1s[0])
        take_away(node1s[0])
        (out / "go").touch()
        result = _await_outcome(out, ("after.json", "dead.json"), node0)
        if bring_back is not None and "tokens" in result:
            node1s.append(bring_back(node1s[0], start_node1))
            (out / "back").touch()
            result["back"] = _await_outcome(out, ("back.json",), node0)
        elif take_away_again is not None and "tokens" in result:
            take_away_again()
            (out / "again").touch()
            result["again"] = _await_outcome(out, ("again.json",), node0)
        else:
            (out / "done").touch()
        assert node0.wait(60) == 0
        return {"before": before, **result}
    finally:
        if node0.poll() is None:
            node0.kill()
            node0.wait(10)
        for node1 in node1s:
            if node1.poll() is None:
                os.killpg(node1.pid, signal.SIGKILL)
                node1.wait(10)


def _await_outcome(out: Path, names: tuple[str, ...], *processes: subprocess.Popen) -> dict | list:
    """The first of `names` that node 0 writes into `out` (it and `processes` must stay up meanwhile)."""
    deadline = time.monotonic() + WAIT_S
    while not any((out / name).exists() for name in names):
        for process in processes:
            assert process.poll() is None, f"{process.args[3:6]} exited {process.returncode}"
        assert time.monotonic() < deadline, f"node 0 wrote none of {names}"
        time.sleep(0.2)
    time.sleep(0.1)   # written whole by now
    return json.loads(next(out / name for name in names if (out / name).exists()).read_text())


def _kill_node(node1: subprocess.Popen) -> None:
    os.killpg(node1.pid, signal.SIGKILL)   # the launcher, its fork server and ranks 2-3


def test_node0_re_forms_when_node1_is_cut_off_and_takes_it_back_when_it_returns(two_nodes, tiny_checkpoint_factory,
                                                                                 tmp_path):
    """8 redundant slots (4 per rank for 8 experts): node 0's two ranks hold every expert, so they go on alone with
    the tokens they gave before. Node 1's link goes down (no connection closes): the control plane's heartbeat
    finds its ranks gone, and the front's interrupt takes node 0's ranks out of the collective they were blocked
    in with them. (Killed ranks close their connections: found at once, the same re-formation follows.) Then node
    1 is started again with the job's key: its ranks say Hello, and the job re-forms at its full size with them."""
    checkpoint = tiny_checkpoint_factory("mixtral")

    def bring_back(cut_off: subprocess.Popen, start_node1) -> subprocess.Popen:
        _kill_node(cut_off)   # a restarted node: its old processes are gone before the link is back
        cut_off.wait(10)
        two_nodes.restore_link()
        return start_node1()

    result = _run(two_nodes, checkpoint, tmp_path, 8, lambda node1: two_nodes.cut_link(), bring_back)
    assert "tokens" in result, result
    assert result["tokens"] == result["before"]
    # node 1's two ranks are two lost ranks (the metric counts ranks, not losses), and both come back
    assert (result["reformations"], result["lost_ranks"], result["dp_size"]) == (1, 2, 2), result
    assert result["healthy"] and result["degraded"]
    back = result["back"]
    assert back["tokens"] == result["before"]
    assert (back["reformations"], back["lost_ranks"], back["returned"], back["dp_size"]) == (2, 2, 2, 4), back
    assert back["healthy"] and not back["degraded"]


@pytest.mark.skipif(LOSS_REFUSED is not None, reason=str(LOSS_REFUSED))
def test_node1_losing_some_packets_is_ridden_through_and_losing_all_is_a_cut(two_nodes, tiny_checkpoint_factory,
                                                                              tmp_path):
    """Node 1's link drops 5% of its packets at random (`tc netem loss`; this machine's kernel has no netem, so
    nftables drops them): TCP sends them again and the job serves on at its full size, no rank lost, the same
    tokens. Then it drops all of them, the link still up: the heartbeat finds node 1's ranks gone and node 0
    re-forms without them, as after a cut."""
    result = _run(two_nodes, tiny_checkpoint_factory("mixtral"), tmp_path, 8, lambda node1: two_nodes.drop_packets(5),
                  take_away_again=lambda: two_nodes.drop_packets(100))
    assert "tokens" in result, result
    assert result["tokens"] == result["before"]
    assert (result["reformations"], result["lost_ranks"], result["dp_size"]) == (0, 0, 4), result
    assert result["healthy"] and not result["degraded"]
    again = result["again"]
    assert again["tokens"] == result["before"]
    assert (again["reformations"], again["lost_ranks"], again["dp_size"]) == (1, 2, 2), again
    assert again["healthy"] and again["degraded"]


def test_a_killed_node_whose_experts_the_rest_cannot_hold_ends_the_engine_naming_why(two_nodes, tiny_checkpoint_factory,
                                                                                  tmp_path):
    """4 redundant slots (3 per rank): node 0 alone holds 6 slots for 8 experts; a job across nodes cannot
    restart itself, so the engine ends with the reason."""
    result = _run(two_nodes, tiny_checkpoint_factory("mixtral"), tmp_path, 4, _kill_node)
    assert "error" in result, result
    assert "6 expert slots per MoE layer, fewer than the model's 8 experts" in result["error"], result
    assert not result["healthy"]
