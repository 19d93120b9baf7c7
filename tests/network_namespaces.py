"""Two "nodes" on one machine: network namespaces joined by a veth pair, each with its own address (root only).

`TwoNodes.create()` makes them and `remove()` takes them away again; `run_in(node, argv)` starts a process inside
one; `cut_link` and `drop_packets` take the second node's link down or make it lose packets. `unavailable()` and
`packet_loss_unavailable()` say why a machine cannot (not root, no `ip` or `nft`, namespaces refused), for the
tests to report."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"moe-probe-{os.getpid()}"
    try:   # what `TwoNodes.create` needs: a namespace, and a veth pair with one end moved into it
        _ip("netns", "add", probe)
        _ip("link", "add", f"mpa{os.getpid() % 100000}", "type", "veth", "peer", "name", f"mpb{os.getpid() % 100000}")
        _ip("link", "set", f"mpb{os.getpid() % 100000}", "netns", probe)
    except subprocess.CalledProcessError as exc:
        return f"network namespaces joined by a veth pair are refused here: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "link", "del", f"mpa{os.getpid() % 100000}"], capture_output=True)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def packet_loss_unavailable() -> str | None:
    """Why packets cannot be dropped at random here (None: they can). The kernel of this machine has no netem
    qdisc (`tc qdisc ... netem loss` says "Specified qdisc kind is unknown"); nftables' `numgen random` drops
    the same share of packets."""
    if shutil.which("nft") is None:
        return "the `nft` command (nftables) is not installed: packet loss is made with its random drop rule"
    probe = f"moe-nft-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _nft(probe, "add table inet probe")
    except subprocess.CalledProcessError as exc:
        return f"nftables is refused in a network namespace here: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _nft(namespace: str, script: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=script, check=True,
                   capture_output=True, text=True)


@dataclass(frozen=True)
class Node:
    namespace: str
    interface: str
    address: str


@dataclass(frozen=True)
class TwoNodes:
    first: Node
    second: Node

    @classmethod
    def create(cls, tag: int) -> "TwoNodes":
        """Namespaces moe-a-<tag> / moe-b-<tag>, 10.231.<tag % 250>.1 and .2 on a veth pair, loopback up in each."""
        subnet = f"10.231.{tag % 250}"
        first = Node(f"moe-a-{tag}", f"mva{tag % 100000}", f"{subnet}.1")
        second = Node(f"moe-b-{tag}", f"mvb{tag % 100000}", f"{subnet}.2")
        nodes = cls(first, second)
        try:
            for node in (first, second):
                _ip("netns", "add", node.namespace)
            _ip("link", "add", first.interface, "type", "veth", "peer", "name", second.interface)
            for node in (first, second):
                _ip("link", "set", node.interface, "netns", node.namespace)
                _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
                _ip("-n", node.namespace, "link", "set", "lo", "up")
                _ip("-n", node.namespace, "link", "set", node.interface, "up")
        except BaseException:
            nodes.remove()
            raise
        return nodes

    def run_in(self, node: Node, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", node.namespace, *argv], env=env, **kwargs)

    def cut_link(self) -> None:
        """The second node's end of the link goes down: its packets stop, no connection is closed."""
        _ip("-n", self.second.namespace, "link", "set", self.second.interface, "down")

    def drop_packets(self, percent: int) -> None:
        """The second node's interface drops `percent`% of the packets it sends and receives, chosen at random (as
        `tc netem loss` would); the link stays up. 0 takes the loss away."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent {percent} is not in 0..100")
        rule = "drop" if percent == 100 else f"numgen random mod 100 < {percent} drop"
        interface = self.second.interface
        script = "table inet moe_loss\ndelete table inet moe_loss\n"   # declared first, so deleting never fails
        if percent:
            script += ("table inet moe_loss {\n"
                       f"  chain in {{ type filter hook input priority 0; iifname {interface} {rule}; }}\n"
                       f"  chain out {{ type filter hook output priority 0; oifname {interface} {rule}; }}\n"
                       "}\n")
        _nft(self.second.namespace, script)

    def restore_link(self) -> None:
        _ip("-n", self.second.namespace, "link", "set", self.second.interface, "up")

    def remove(self) -> None:
        for node in (self.first, self.second):
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True)
