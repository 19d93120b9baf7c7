"""Server test harness: the real `moe-serve` in a subprocess, and fake engines for in-process app tests.

`ServerProcess` starts `python -m moe_runtime.server.cli` on a free loopback port (`--port 0`; the
launcher prints the port it got), waits for /health to answer 200, and stops it with SIGTERM
(SIGKILL if it hangs), reporting the exit code so a test can hold the shutdown to account.

`serve_in_process` runs a scenario against `build_app` over the ASGI transport (one event loop, no
socket); `free_port` picks a loopback port for a server that must be reached before it announces itself.

`FakeEngine` implements the `Engine` protocol in pure Python with a predictable token stream
(token i of a request = prompt[-1] + 1 + i, text = the tokens joined by spaces) and switches to
make it die (`die_at_step`, `crash_at_step`, `health_fails_at_step`); `step_delay_s` paces it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from moe_runtime.engine.stats import EngineHealth, EngineStats, WorkerStats
from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"moe-serve: serving .* on http://([^\s]+):(\d+)")


@dataclass(frozen=True)
class InstalledMoeServe:
    """The `moe-serve` script of another environment (a scratch venv), run from `cwd`."""
    script: Path
    cwd: Path


class ServerProcess:
    """A `moe-serve` subprocess. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, args: list[str], startup_timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 subcommand: list[str] = (), installed: "InstalledMoeServe | None" = None):
        """`subcommand` goes first (`["router"]`: `moe-serve router ...`). `installed`: run another environment's
        `moe-serve` script from another directory, with nothing of this checkout on its path."""
        self.installed = installed
        self.args = list(args)
        self.subcommand = list(subcommand)
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    def openai_client(self, api_key: str, timeout: float = 60):
        """The official client against this server, retries off (a failure shows at once)."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def http_client(self, api_key: str, timeout: float = 60) -> httpx.Client:
        """An httpx client sending the key as a bearer token."""
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)

    def start(self) -> "ServerProcess":
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(self.env or {}))
        if self.installed is None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            launcher, cwd = [sys.executable, "-m", "moe_runtime.server.cli"], REPO_ROOT
        else:
            env.pop("PYTHONPATH", None)
            launcher, cwd = [str(self.installed.script)], self.installed.cwd
        command = [*launcher, *self.subcommand, "--host", "127.0.0.1", "--port", "0", *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, cwd=cwd)
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._listening.wait(0.1):
            if self.process.poll() is not None:
                raise RuntimeError(f"moe-serve exited with {self.process.returncode} before listening:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moe-serve did not listen within {self.startup_timeout_s}s:\n{self.tail()}")
        while True:  # listening is announced once uvicorn is up; /health must agree
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"/health never answered 200:\n{self.tail()}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code (None if it had to be killed)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.log)[-lines:])

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.rstrip("\n"))
            match = LISTENING.search(line)
            if match and not self._listening.is_set():
                self.base_url = f"http://{match.group(1)}:{match.group(2)}"
                self._listening.set()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    """A loopback port free right now (another process could take it before it is used: rare)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_in_process(engine, scenario, max_queue: int | None = None, timeout_s: float = 30.0,
                     raise_app_exceptions: bool = True, **app_kwargs):
    """`await scenario(client, async_engine)` against `build_app(AsyncEngine(engine), "fake", **app_kwargs)`.

    `raise_app_exceptions=False` lets a test see the 500 a server sends for an exception it re-raises to
    its log (as uvicorn would), instead of the exception.
    """
    from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
    from moe_runtime.server import build_app

    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=max_queue)).start()
        app = build_app(async_engine, "fake", **app_kwargs)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as client:
                return await scenario(client, async_engine)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), timeout_s))


# ---- a fake engine for in-process app tests ----------------------------------------------------

@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)


class FakeEngine:
    """A pure-Python `Engine`: one token per running request per step, `max_running` at a time."""

    def __init__(self, max_running: int = 8, step_delay_s: float = 0.0, vocab_size: int = 1000,
                 max_model_len: int = 100_000, die_at_step: int | None = None, crash_at_step: int | None = None,
                 health_fails_at_step: int | None = None, expert_load=None, rebalance_events=()):
        self.tokenizer = None
        self.max_model_len = max_model_len
        self.limits = RequestLimits(vocab_size, max_model_len, kv_capacity_tokens=max_model_len, has_tokenizer=False)
        self.max_running = max_running
        self.prefix_cache_resets = 0
        self.step_delay_s = step_delay_s
        self.vocab_size = vocab_size
        self.die_at_step = die_at_step
        self.crash_at_step = crash_at_step
        self.health_fails_at_step = health_fails_at_step
        self.snapshot = expert_load
        self.events = list(rebalance_events)
        self.steps = 0
        self.waiting: collections.deque[_FakeRequest] = collections.deque()
        self.running: list[_FakeRequest] = []
        self.aborted: list[str] = []
        self.shut_down = False
        self.dead: str | None = None        # why the fake died (health() says it, as the front keeps its death)
        self._on_outputs = None             # attached: where an abort's last output goes
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._lock = threading.RLock()      # the driver thread steps; the loop admits and aborts
        self._driver: threading.Thread | None = None
        self._detached = threading.Event()

    @staticmethod
    def expected_tokens(prompt: list[int], n: int) -> list[int]:
        return [prompt[-1] + 1 + i for i in range(n)]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token id outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")
        self.waiting.append(_FakeRequest(request_id, list(prompt_token_ids), params))
        self.prompt_tokens += len(prompt_token_ids)

    def abort(self, request_id: str) -> bool:
        """As `Front.abort`: attached, the request's last output (finish_reason "abort") is delivered before this
        returns."""
        if self.dead is not None:
            return False
        with self._lock:
            request = self._abort(request_id)
        if request is None:
            return False
        if self._on_outputs is not None:
            self._on_outputs([RequestOutput(
                request_id=request_id, prompt_token_ids=request.prompt, token_ids=list(request.tokens),
                text=" ".join(str(t) for t in request.tokens), finished=True, finish_reason="abort",
                new_token_ids=[])])
        return True

    def _abort(self, request_id: str) -> _FakeRequest | None:
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self.aborted.append(request_id)
                    return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.die_at_step is not None and self.steps >= self.die_at_step:
            raise EngineDeadError("rank 1 died (fake)")
        if self.crash_at_step is not None and self.steps >= self.crash_at_step:
            raise RuntimeError("fake engine bug")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        outputs = []
        for request in list(self.running):
            token = request.prompt[-1] + 1 + len(request.tokens)
            request.tokens.append(token)
            self.generation_tokens += 1
            finished = len(request.tokens) >= request.params.max_tokens
            if finished:
                self.running.remove(request)
            outputs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt, token_ids=list(request.tokens),
                text=" ".join(str(t) for t in request.tokens), finished=finished,
                finish_reason="length" if finished else None, new_token_ids=[token],
                new_text=(" " if len(request.tokens) > 1 else "") + str(token)))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats([WorkerStats(0, len(self.running), len(self.waiting), 100, 100 - len(self.running), 0)],
                           self.prompt_tokens, self.generation_tokens)

    def health(self) -> EngineHealth:
        if self.dead is not None:
            return EngineHealth(False, self.dead)
        if self.health_fails_at_step is not None and self.steps >= self.health_fails_at_step:
            return EngineHealth(False, "rank 3 stopped answering (fake)")
        return EngineHealth(True)

    def load_snapshot(self):
        """What `expert_load()` answers (subclasses: their recorder's snapshot)."""
        return self.snapshot

    def rebalance_events(self) -> list:
        return list(self.events)

    def rebalance_event(self):
        """What `rebalance_now()` answers (subclasses: a planned RebalanceEvent)."""
        raise InvalidRequestError("the fake engine has one rank: nothing to rebalance")

    def _die_with(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason

    def shutdown(self) -> None:
        self.detach()
        self.shut_down = True

    # ---- the rest of the front's face (`Engine`), as AsyncEngine drives it ----------------------------
    def prepare(self, request_id, prompt_token_ids, params, export_kv=False, import_kv=None):
        return (request_id, list(prompt_token_ids), params)

    def admit(self, admission) -> None:
        with self._lock:
            self.add_request(*admission)

    def refuse_import(self, handle) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    @staticmethod
    def _answer(produce) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(produce())
        except Exception as exc:  # noqa: BLE001 - the caller awaits it
            future.set_exception(exc)
        return future

    def expert_load(self) -> concurrent.futures.Future:
        return self._answer(self.load_snapshot)

    def rebalance_now(self) -> concurrent.futures.Future:
        return self._answer(self.rebalance_event)

    def attach(self, on_outputs, on_death) -> None:
        """A driver thread steps the fake while it has work (the real front's in-process core does the same)."""
        loop = asyncio.get_running_loop()
        self._on_outputs = on_outputs
        self._driver = threading.Thread(target=self._drive, args=(loop, on_outputs, on_death), daemon=True)
        self._driver.start()

    def _drive(self, loop, on_outputs, on_death) -> None:
        while not self._detached.is_set():
            try:
                with self._lock:
                    outputs = self.step() if self.has_unfinished() else None
                health = self.health()
                if not health.healthy:
                    raise EngineDeadError(health.detail)
            except EngineDeadError as exc:
                self._die_with(str(exc))
                loop.call_soon_threadsafe(on_death, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a crashed fake is a dead engine
                self._die_with(f"the engine core failed: {exc!r}")
                loop.call_soon_threadsafe(on_death, f"the engine core failed: {exc!r}")
                return
            if outputs:
                loop.call_soon_threadsafe(on_outputs, outputs)
            elif outputs is None:
                self._detached.wait(0.002)   # idle: a fake may sleep where the real core waits on its queue

    def detach(self) -> None:
        self._detached.set()
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join(timeout=10)
