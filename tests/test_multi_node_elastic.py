"""A two-node job in two network namespaces joined by a veth pair (its addresses exist inside them only): node 1's
ranks are killed, or its link is cut, and node 0's ranks re-form without them when they still hold a slot for
every expert, or the engine ends naming why not. Root and iproute2 are needed; where the machine refuses network
namespaces the tests say so and skip."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attention_dp.control_key import CONTROL_KEY_ENV
from network_namespaces import TwoNodes, unavailable
from moe_runtime.processes.distributed import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

DRIVER = Path(__file__).with_name("multi_node_driver.py")
WAIT_S = 240


@pytest.fixture
def two_nodes():
    nodes = TwoNodes.create(os.getpid() % 200 + 10)
    yield nodes
    nodes.remove()


def _env(interface: str) -> dict:
    tests = str(Path(__file__).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=interface,
               **{CONTROL_KEY_ENV: secrets.token_hex(32) if CONTROL_KEY_ENV not in os.environ else os.environ[CONTROL_KEY_ENV]})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), tests, env.get("PYTHONPATH")]))
    return env


def _await_file(path: Path, *processes: subprocess.Popen) -> dict | list:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        for process in processes:
            assert process.poll() is None or path.exists(), f"{process.args[3:6]} exited {process.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} within {WAIT_S}s"
        time.sleep(0.2)
    time.sleep(0.1)   # written whole by now
    return json.loads(path.read_text())


def _run(nodes: TwoNodes, checkpoint: Path, out: Path, redundant: int, take_away) -> dict:
    """Node 0 (the front and ranks 0-1) and node 1 (`moe-serve --node-rank 1`: ranks 2-3); after the first
    answers, `take_away(node1)`; returns what node 0 wrote after that (after.json or dead.json)."""
    master_port, control_port = free_ports(2)
    key = secrets.token_hex(32)
    addr = nodes.first.address
    node0 = nodes.run_in(nodes.first, [sys.executable, str(DRIVER), str(checkpoint), str(out), addr, str(master_port),
                                        str(control_port), str(redundant)],
                         env={**_env(nodes.first.interface), CONTROL_KEY_ENV: key})
    node1 = nodes.run_in(nodes.second, [sys.executable, "-m", "server.cli", "--model", str(checkpoint), "--device",
                                        "cpu", "--ep", "4", "--dp-attn", "4", "--nnodes", "2", "--node-rank", "1",
                                        "--master-addr", addr, "--master-port", str(master_port), "--control-port",
                                        str(control_port), "--num-redundant-experts", str(redundant),
                                        "--log-level", "warning"],
                         env={**_env(nodes.second.interface), CONTROL_KEY_ENV: key}, start_new_session=True)
    try:
        before = _await_file(out / "before.json", node0, node1)
        take_away(node1)
        (out / "go").touch()
        deadline = time.monotonic() + WAIT_S
        while not any((out / name).exists() for name in ("after.json", "dead.json")):
            assert node0.poll() is None, f"node 0 exited {node0.returncode}"
            assert time.monotonic() < deadline, "node 0 wrote no outcome"
            time.sleep(0.2)
        time.sleep(0.1)
        result = json.loads(next(out / n for n in ("after.json", "dead.json") if (out / n).exists()).read_text())
        assert node0.wait(60) == 0
        return {"before": before, **result}
    finally:
        for process in (node0, node1):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL) if process is node1 else process.kill()
                process.wait(10)


def _kill_node(node1: subprocess.Popen) -> None:
    os.killpg(node1.pid, signal.SIGKILL)   # the launcher, its fork server and ranks 2-3


def test_node0_re_forms_when_node1_is_cut_off(two_nodes, tiny_checkpoint_factory, tmp_path):
    """8 redundant slots (4 per rank for 8 experts): node 0's two ranks hold every expert, so they go on alone with
    the tokens they gave before. Node 1's link goes down (no connection closes): the control plane's heartbeat
    finds its ranks gone, and the front's interrupt takes node 0's ranks out of the collective they were blocked
    in with them. (Killed ranks close their connections: found at once, the same re-formation follows.)"""
    checkpoint = tiny_checkpoint_factory("mixtral")
    result = _run(two_nodes, checkpoint, tmp_path, 8, lambda node1: two_nodes.cut_link())
    assert "tokens" in result, result
    assert result["tokens"] == result["before"]
    assert (result["reformations"], result["lost_ranks"], result["dp_size"]) == (1, 1, 2), result
    assert result["healthy"] and result["degraded"]


def test_a_killed_node_whose_experts_the_rest_cannot_hold_ends_the_engine_naming_why(two_nodes, tiny_checkpoint_factory,
                                                                                  tmp_path):
    """4 redundant slots (3 per rank): node 0 alone holds 6 slots for 8 experts; a job across nodes cannot
    restart itself, so the engine ends with the reason."""
    result = _run(two_nodes, tiny_checkpoint_factory("mixtral"), tmp_path, 4, _kill_node)
    assert "error" in result, result
    assert "6 expert slots per MoE layer, fewer than the model's 8 experts" in result["error"], result
    assert not result["healthy"]
