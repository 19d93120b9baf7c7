"""`moe-serve --pd P:D ...`: a whole prefill/decode set on this machine, for trying it out.

Starts P prefill and D decode instances (`moe-serve --disaggregation-mode prefill|decode`, each with
the flags given here, plus --pd-prefill-args / --pd-decode-args for its role, on a free loopback
port) and the router on --host/--port in front of them. The instances share a fresh KV transfer
secret (unless $MOE_RUNTIME_KV_KEY or --kv-transfer-key-file names one), handed over in their
environment. Their output is forwarded here, each line prefixed with its instance. Ctrl-C or
SIGTERM stops the router, then the instances (exit code 0).

An instance that exits while the set serves (it crashed, its engine died, it was killed) stops the
whole set, with a line naming it and its exit code, and `moe-serve --pd` exits 1: as a moe-serve
whose rank dies, the set does not limp on with a role missing; whoever supervises it restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from moe_runtime.security.transfer_key import KV_KEY_ENV
from moe_runtime.server.pd_router.backends import BackendPool
from moe_runtime.server.pd_router.cli import serve_router
from moe_runtime.server.server_config import ServerConfig, ServerConfigError

logger = logging.getLogger(__name__)

SERVING = re.compile(r"moe-serve: serving .* on (http://\S+)")
LAUNCHER_FLAGS = {"--pd", "--pd-prefill-args", "--pd-decode-args", "--host", "--port", "--disaggregation-mode"}
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0


@dataclass
class Instance:
    name: str                      # "prefill0", "decode1"
    process: subprocess.Popen
    url: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    on_exit: Callable[[], None] | None = None      # called on the output thread once the process has exited

    def forward_output(self) -> None:
        """Echo the instance's lines, its name in them (`moe-serve[prefill0]: ...`, so only the router's own line
        says `moe-serve: serving`); note its URL once it serves."""
        for line in self.process.stdout:
            shown = line.replace("moe-serve: ", f"moe-serve[{self.name}]: ", 1)
            print(shown if shown != line else f"[{self.name}] {line}", end="", flush=True)
            match = SERVING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self.ready.set()
        self.process.wait()
        self.ready.set()   # it exited: whoever waits must look
        if self.on_exit is not None:
            self.on_exit()


def instance_args(argv: list[str]) -> list[str]:
    """The flags every instance gets: ours, less the launcher's own (which take one value each)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCHER_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def start_instance(name: str, role: str, args: list[str], env: dict) -> Instance:
    command = [sys.executable, "-m", "moe_runtime.server.cli", *args, "--disaggregation-mode", role, "--host", "127.0.0.1",
               "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    instance = Instance(name, process)
    threading.Thread(target=instance.forward_output, name=f"{name}-output", daemon=True).start()
    return instance


async def first_exit(instances: list[Instance]) -> str:
    """Wait (woken by the instances' output threads, no polling) until one instance exits; which and how."""
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(exited.set)
        except RuntimeError:
            pass   # the loop is closed: the set is stopping anyway

    for instance in instances:
        instance.on_exit = wake
    while True:
        gone = [instance for instance in instances if instance.process.poll() is not None]
        if gone:
            instance = gone[0]
            return (f"the {instance.name} instance (pid {instance.process.pid}) exited with code "
                    f"{instance.process.returncode}; the P/D set stops (exit code 1) for its supervisor to restart")
        await exited.wait()
        exited.clear()


def stop(instances: list[Instance]) -> None:
    for instance in instances:
        if instance.process.poll() is None:
            instance.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for instance in instances:
        try:
            instance.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            instance.process.kill()
            instance.process.wait(5)


def serve_pd_set(server: ServerConfig, argv: list[str]) -> int:
    num_prefill, num_decode = server.pd_counts()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "--kv-transfer-key-file" not in " ".join(argv) and not env.get(KV_KEY_ENV):
        env[KV_KEY_ENV] = secrets.token_hex(32)   # this set's own secret; it never leaves this machine
    common = instance_args(argv)
    instances: list[Instance] = []
    previous = signal.signal(signal.SIGTERM, _raise_terminated)   # stopped while starting: stop the instances too
    try:
        for role, count, extra in (("prefill", num_prefill, server.pd_prefill_args),
                                   ("decode", num_decode, server.pd_decode_args)):
            for index in range(count):
                instances.append(start_instance(f"{role}{index}", role, [*common, *shlex.split(extra)], env))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for instance in instances:
            instance.ready.wait(max(deadline - time.monotonic(), 0))
            if instance.url is None:
                raise ServerConfigError(f"--pd: the {instance.name} instance did not start (exit code "
                                        f"{instance.process.poll()}; its output is above)")
        print("".join(f"moe-serve: {i.name} instance (pid {i.process.pid}) on {i.url}\n" for i in instances),
              end="", flush=True)
        pool = BackendPool.of([i.url for i in instances if i.name.startswith("prefill")],
                              [i.url for i in instances if i.name.startswith("decode")])
        signal.signal(signal.SIGTERM, previous)   # the router handles it from here
        key = server.api_keys[0] if server.api_keys else None
        return serve_router(pool, server.host, server.port, key, key, server.max_request_bytes,
                            log_level=server.log_level, stop_when=lambda: first_exit(instances))
    except _Terminated:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop(instances)


class _Terminated(Exception):
    """SIGTERM while the instances start."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()
