"""ZeroMQ ends that fail or are dropped unclosed release everything and never hang the process.

CI once hung for the whole 600 s test timeout inside an unrelated test: a rank end whose start-up had failed was
kept alive by a test's traceback, and when the garbage collector took the cycle, pyzmq's context finalizer waited
forever for sockets whose own finalizers had not run yet.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_runtime.attention_dp.control_plane import ControlAddress, FrontControl, WorkerControl
from moe_runtime.attention_dp.messages import Hello
from moe_runtime.security.control_key import ControlKey

from test_control_plane_security import _setup

DROPPED_IN_A_CYCLE = """
import gc, zmq
from moe_runtime.security.closing_context import ClosingContext

class Owner:
    def __init__(self):
        self.context = ClosingContext()
        self.socket = self.context.socket(zmq.DEALER)
        self.monitor = self.socket.get_monitor_socket()
        self.socket.connect("tcp://127.0.0.1:9")
        self.me = self   # a cycle, as a caller's kept traceback makes one

gc.disable()
for _ in range(3):
    Owner()
gc.collect()   # with a plain zmq.Context this waits forever
print("collected", flush=True)
"""


def test_a_context_dropped_unclosed_in_a_reference_cycle_is_collected_without_hanging():
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", DROPPED_IN_A_CYCLE], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout == "collected\n", done.stderr


def _failed_end(refused: pytest.ExceptionInfo) -> WorkerControl:
    """The half-made end, from its `__init__` frame in the traceback (what keeps it alive)."""
    ends = [entry.frame.f_locals.get("self") for entry in refused.traceback]
    return next(end for end in ends if isinstance(end, WorkerControl))


def _is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
    except OSError:
        return False
    return True


def test_a_rank_end_that_cannot_join_closes_its_sockets_before_raising():
    front = FrontControl(ControlAddress.tcp("127.0.0.1", 0, ControlKey.generate()), _setup())
    try:
        wrong = ControlAddress.tcp("127.0.0.1", front.address.port, ControlKey.generate())
        with pytest.raises(TimeoutError, match="same control key") as refused:
            WorkerControl(wrong, Hello(rank=0, pid=0, host="test"), connect_timeout_s=1.0)
        end = _failed_end(refused)   # the traceback held here keeps it alive: all of it is closed anyway
        assert end._socket.closed and end._monitor.closed and end._context.closed
        assert not _is_open(end._wake_read) and not _is_open(end._wake_write)
    finally:
        front.close()
