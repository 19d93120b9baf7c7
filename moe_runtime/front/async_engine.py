"""Drive an `Engine` from asyncio.

Two ways, chosen by the engine:
- event-driven (`EventDrivenEngine`: ranks in worker processes). The engine is attached to the
  running loop on first use: requests and aborts go straight out on the control socket from the
  loop, and each rank message is taken in by the loop as it arrives (ZeroMQ socket registered
  with the loop); outputs reach their streams in the same loop iteration. No thread, no polling.
- an engine thread (an engine that computes in this process, `LocalEngine`). A single background
  thread calls every engine method. The event loop hands it commands (add, abort, stop) through a
  thread-safe queue, applied between steps; after each step the thread posts every request's
  output back to the event loop of the coroutine that submitted it, and refreshes the
  stats/health/expert-load snapshots that the event loop reads without touching the engine.

When the engine dies (`step()` raises, or `health()` turns unhealthy) every in-flight request
ends with `EngineDeadError`, later submissions fail at once, and `health()` says why: nothing
waits forever on a dead engine. A request the engine failed on its own (finish_reason "error")
ends with `RequestFailedError`, for its caller only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from moe_runtime.front.engine_protocol import Engine, EngineHealth, EngineStats, EventDrivenEngine
from moe_runtime.errors import EngineDeadError, MoERuntimeError, QueueFullError, RequestFailedError  # noqa: F401
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None (the engine thread, a signal handler's caller)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


@dataclass(frozen=True)
class AsyncEngineConfig:
    max_queue: int | None = None         # requests waiting for their first token; None = unbounded
    retry_after_s: int = 1               # what a QueueFullError tells the client to wait
    idle_poll_s: float = 0.1             # how often an idle engine thread checks health and commands
    expert_load_refresh_s: float = 1.0   # how often the expert-load snapshot is refreshed while wanted
    expert_load_interest_s: float = 30.0 # refresh only while someone asked for it this recently
    event_driven: bool | None = None     # None: when the engine can be (ranks elsewhere); False forces the
                                         # engine thread (the design before the event-driven front; benchmarks)

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue}: must be >= 1 (or None for no bound)")


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for a consumer that fell behind: the later state, with both outputs' new parts."""
    new_logprobs = None
    if later.new_logprobs is not None:
        new_logprobs = (earlier.new_logprobs or []) + later.new_logprobs
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               new_text=earlier.new_text + later.new_text, new_logprobs=new_logprobs,
                               sampled_at=earlier.sampled_at or later.sampled_at)  # the oldest token's


class RequestStream:
    """The outputs of one request, in the order the engine produced them (an async iterator).

    When the consumer falls behind, the outputs waiting for it are merged into one (`merge_outputs`:
    the latest state with all their new tokens, logprobs and text).
    The last output has `finished=True`; an engine failure raises `EngineDeadError` instead, and a
    request the engine failed alone raises `RequestFailedError`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.loop = loop
        self.finished = False
        self.started = False                           # first output delivered (loop side)
        self.last_output: RequestOutput | None = None  # engine-thread side: latest output produced
        self.token_times: list[float] = []             # perf_counter when each token reached the loop
        self._items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._items.get()
        while not isinstance(item, BaseException) and not item.finished and not self._items.empty():
            newer = self._items.get_nowait()
            if isinstance(newer, BaseException):
                item = newer
                break
            item = merge_outputs(item, newer)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side: queue one output (or the error that ends the request)."""
        if isinstance(item, RequestOutput) and item.new_token_ids:
            now = time.perf_counter()
            self.token_times.extend(now for _ in item.new_token_ids)
        self._items.put_nowait(item)


@dataclass
class _Add:
    stream: RequestStream
    params: SamplingParams
    admitted: concurrent.futures.Future
    transfer: dict                 # export_kv / import_kv for a P/D instance; {} otherwise


class _Wake:
    """A KV transfer event waits for the engine thread (a release, a pull that ended)."""


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result or error goes to `done`."""

    fn: Callable[[Engine], Any]
    done: concurrent.futures.Future


class _Stop:
    pass


class AsyncEngine:
    """An `Engine` behind an asyncio face. Call `start()` once, `shutdown()` at the end."""

    def __init__(self, engine: Engine, config: AsyncEngineConfig = AsyncEngineConfig()):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # the engine checks specs at admission on the loop: the server parses them first, off the loop, in this cache
        self.structured_output_validator = engine.limits.structured_output
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()          # guards _dead_detail and the hand-off of commands
        self._dead_detail: str | None = None
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._unstarted = 0                    # submitted, no output yet (guarded by _lock)
        self._stats = EngineStats()
        self._health = EngineHealth(True)
        self._expert_load = None
        self._rebalance_events: list = []
        self._expert_load_at = float("-inf")
        self._expert_load_wanted_at = float("-inf")   # a plain float store from the loop thread
        self._thread: threading.Thread | None = None
        self._stop_requested = False           # set by begin_shutdown (a plain store: signal-safe)
        self._event_driven = isinstance(engine, EventDrivenEngine) and config.event_driven is not False
        self._loop: asyncio.AbstractEventLoop | None = None   # event-driven: the loop it is attached to
        self._load_refresh: asyncio.Task | None = None
        self._death_waiters: list[asyncio.Future] = []   # guarded by _lock

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._refresh_snapshots(force_expert_load=True)
        if self._event_driven:
            return self  # attached to the loop of its first caller there (the loop may not run yet)
        set_wake = getattr(self.engine, "set_wake", None)
        if set_wake is not None:   # KV transfer events wake the engine thread instead of waiting for a poll
            set_wake(lambda: self._commands.put(_Wake()))
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread: in-flight requests end with `EngineDeadError`; then `engine.shutdown()`."""
        if self._event_driven:
            self._detach()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_Stop())
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error("engine thread did not stop within %.1fs (a step is stuck)", timeout_s)
                return
        self._fail_everything("the server is shutting down")
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway; say what went wrong
            logger.exception("engine.shutdown() failed")

    def begin_shutdown(self) -> None:
        """Thread- and signal-safe: ask the engine thread to stop (in-flight requests end with an error)."""
        self._stop_requested = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._die, "the server is shutting down")

    def _attach_here(self) -> None:
        """Event-driven: attach the engine to the running loop, once."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.engine.attach(self._deliver, self._die)

    def _detach(self) -> None:
        """Event-driven: stop the loop's readers (from the loop's thread or any other)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self.engine.detach()
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(self._detach_soon(), loop).result(timeout=5)

    async def _detach_soon(self) -> None:
        self.engine.detach()
        await asyncio.sleep(0)  # let the cancelled readers unwind before the sockets close

    # ---- event-loop API --------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     export_kv: bool = False, import_kv: KVHandle | None = None) -> RequestStream:
        """Admit a request; returns its output stream once the engine accepted it. `export_kv` / `import_kv`:
        a prefill / decode instance's half of a disaggregated request (see `Engine.add_request`).

        Raises `InvalidRequestError` (the engine's validation), `QueueFullError`, `EngineDeadError`; the
        stream raises `EngineDeadError` or `RequestFailedError` if the request cannot finish.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, list(prompt_token_ids), loop)
        transfer = {name: value for name, value in (("export_kv", export_kv), ("import_kv", import_kv)) if value}
        if self._event_driven:
            return self._submit_here(stream, params, transfer)
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._admit_or_refuse()
            self._commands.put(_Add(stream, params, admitted, transfer))
        try:
            await asyncio.wrap_future(admitted)
        except BaseException:
            refused = admitted.done() and not admitted.cancelled() and admitted.exception() is not None
            if not refused:
                self.abort(request_id)  # the caller gave up waiting: the engine may have admitted it anyway
            self._mark_started(stream)
            raise
        return stream

    def _admit_or_refuse(self) -> None:
        """Count a new request against max_queue (caller holds the lock)."""
        if self._dead_detail is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead_detail}")
        limit = self.config.max_queue
        if limit is not None and self._unstarted >= limit:
            raise QueueFullError(
                f"{self._unstarted} requests are already waiting for their first token "
                f"(--max-queue {limit}); retry later",
                self.config.retry_after_s,
            )
        self._unstarted += 1

    def _submit_here(self, stream: RequestStream, params: SamplingParams, transfer: dict) -> RequestStream:
        """Event-driven: admit on the loop; the request is on its way to the ranks when this returns."""
        self._attach_here()
        with self._lock:
            self._admit_or_refuse()
        try:
            if stream.request_id in self._streams:
                raise ValueError(f"request id {stream.request_id!r} is already in use")
            self.engine.add_request(stream.request_id, stream.prompt_token_ids, params, **transfer)
        except BaseException:
            self._mark_started(stream)
            raise
        self._streams[stream.request_id] = stream
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step (the last has finished=True).

        Leaving the loop early (break, cancellation, client gone) aborts the request.
        """
        stream = await self.submit(request_id, prompt_token_ids, params)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed between steps); unknown ids are ignored."""
        if self._event_driven and self._loop is not None and self._dead_detail is None:
            self._abort(request_id)  # on the loop: straight to the ranks
        else:
            self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        if self._event_driven and self._dead_detail is None:
            return self.engine.stats()  # kept current by the loop as rank messages arrive
        return self._stats

    def health(self) -> EngineHealth:
        with self._lock:
            if self._dead_detail is not None:
                return EngineHealth(False, self._dead_detail)
        if self._event_driven:
            return self.engine.health()
        return self._health

    def expert_load(self):
        """The latest `ExpertLoadSnapshot`, or None.

        Taking one can be a lock-step command across every rank, so the engine thread refreshes it
        (every `expert_load_refresh_s`) only while callers keep asking for it.
        """
        self._expert_load_wanted_at = time.monotonic()
        if self._event_driven and self._loop is not None:
            self._refresh_load_soon()
        return self._expert_load

    def _refresh_load_soon(self) -> None:
        """Event-driven: refresh the expert-load snapshot in the background when it is stale."""
        stale = time.monotonic() - self._expert_load_at >= self.config.expert_load_refresh_s
        if stale and (self._load_refresh is None or self._load_refresh.done()) and self._dead_detail is None:
            self._load_refresh = self._loop.create_task(self.fresh_expert_load())

    def rebalance_events(self) -> list:
        """The engine's `RebalanceEvent`s so far (refreshed with the expert load); [] if it keeps none."""
        self._expert_load_wanted_at = time.monotonic()
        if self._event_driven:
            return self.engine.rebalance_events()
        return self._rebalance_events

    async def call(self, fn: Callable[[Engine], Any], timeout_s: float | None = None) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result.

        For the rare engine operations a front end needs beyond requests (e.g. the dashboard's
        `lambda e: e.rebalance_now()`). Raises what `fn` raised, or `EngineDeadError`.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead_detail is not None:
                raise EngineDeadError(f"the engine is not running: {self._dead_detail}")
            if self._event_driven:  # no engine thread: run it here (it must not block)
                return fn(self.engine)
            self._commands.put(_Call(fn, done))
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)

    async def rebalance_now(self, timeout_s: float | None = None):
        """Plan a placement from the recorded window and migrate now; the engine's RebalanceEvent."""
        if not self._event_driven:
            return await self.call(lambda engine: engine.rebalance_now(), timeout_s)
        self._attach_here()
        if self._dead_detail is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead_detail}")
        return await asyncio.wait_for(self.engine.rebalance_now_async(), timeout_s)

    async def fresh_expert_load(self, timeout_s: float = 10.0):
        """An expert-load snapshot taken now (between steps); the cached one if the engine is slow or gone."""
        if self._event_driven:
            self._attach_here()
            try:
                self._expert_load = await asyncio.wait_for(self.engine.expert_load_async(), timeout_s)
                self._expert_load_at = time.monotonic()
            except (asyncio.TimeoutError, MoERuntimeError):
                pass
            return self._expert_load
        try:
            await self.call(lambda _: self._refresh_load_balancer_views(), timeout_s)
        except (asyncio.TimeoutError, MoERuntimeError):
            pass
        return self.expert_load()

    @property
    def num_unstarted(self) -> int:
        """Requests submitted that have not produced their first output yet (the queue `max_queue` bounds)."""
        return self._unstarted

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop_requested:
                busy = self.engine.has_unfinished()
                if not self._apply_commands(block=not busy):
                    break
                outputs = self.engine.step() if self.engine.has_unfinished() else None
                self._refresh_snapshots()  # before delivering: a client woken by its output sees stats that count it
                if outputs is not None:
                    self._deliver(outputs)
                if not self._health.healthy:
                    raise EngineDeadError(self._health.detail)
        except EngineDeadError as exc:
            logger.error("engine died: %s", exc)
            self._die(str(exc))
            return
        except BaseException as exc:  # noqa: BLE001 - any crash leaves the engine in an unknown state
            logger.exception("engine thread crashed")
            self._die(f"engine thread crashed: {exc!r}")
            return
        self._die("the server is shutting down")

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; wait up to idle_poll_s for one when `block`. False on stop."""
        try:
            command = self._commands.get(timeout=self.config.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _Call):
                self._run_call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        if not command.admitted.set_running_or_notify_cancel():
            return  # the caller stopped waiting before the engine saw it
        stream = command.stream
        try:
            if stream.request_id in self._streams:
                raise ValueError(f"request id {stream.request_id!r} is already in use")
            self.engine.add_request(stream.request_id, stream.prompt_token_ids, command.params, **command.transfer)
        except EngineDeadError:
            command.admitted.set_exception(EngineDeadError("the engine died while admitting the request"))
            raise
        except Exception as exc:  # noqa: BLE001 - validation errors go back to the caller
            command.admitted.set_exception(exc)
            return
        self._streams[stream.request_id] = stream
        command.admitted.set_result(None)

    def _run_call(self, command: _Call) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the caller timed out or was cancelled before its turn
        try:
            result = command.fn(self.engine)
        except EngineDeadError as exc:
            command.done.set_exception(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's operation failed, the engine did not
            command.done.set_exception(exc)
            return
        command.done.set_result(result)

    def _refresh_load_balancer_views(self) -> None:
        self._expert_load = self.engine.expert_load()
        events = getattr(self.engine, "rebalance_events", None)
        self._rebalance_events = list(events()) if events is not None else []
        self._expert_load_at = time.monotonic()

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        last = stream.last_output
        final = RequestOutput(
            request_id=request_id,
            prompt_token_ids=stream.prompt_token_ids,
            token_ids=list(last.token_ids) if last else [],
            text=last.text if last else "",
            finished=True,
            finish_reason="abort",
            logprobs=last.logprobs if last else None,
            num_preemptions=last.num_preemptions if last else 0,
            new_token_ids=[],
        )
        self._post([(stream, final)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted between the step and now
            stream.last_output = output
            if output.finished:
                del self._streams[output.request_id]
            if output.finished and output.finish_reason == "error":
                items.append((stream, RequestFailedError(output.request_id, output.error or "unknown error")))
            else:
                items.append((stream, output))
        self._post(items)

    def _post(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Hand items to their event loops: one wake-up per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        running = _running_loop()
        for loop, batch in by_loop.items():
            if loop is running:  # event-driven: already on the streams' loop, no extra hop
                self._receive(batch)
                continue
            try:
                loop.call_soon_threadsafe(self._receive, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                logger.debug("dropping %d outputs for a closed event loop", len(batch))

    def _receive(self, batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Event-loop side of `_post`."""
        for stream, item in batch:
            self._mark_started(stream)
            stream._put(item)

    def _mark_started(self, stream: RequestStream) -> None:
        with self._lock:
            if not stream.started:
                stream.started = True
                self._unstarted -= 1

    def _refresh_snapshots(self, force_expert_load: bool = False) -> None:
        self._stats = self.engine.stats()
        self._health = self.engine.health()
        now = time.monotonic()
        wanted = now - self._expert_load_wanted_at < self.config.expert_load_interest_s
        stale = now - self._expert_load_at >= self.config.expert_load_refresh_s
        if force_expert_load or (wanted and stale):
            self._refresh_load_balancer_views()

    def _die(self, detail: str) -> None:
        with self._lock:
            if self._dead_detail is None:
                self._dead_detail = detail
            waiters, self._death_waiters = self._death_waiters, []
        for waiter in waiters:
            try:
                waiter.get_loop().call_soon_threadsafe(_resolve, waiter, self._dead_detail)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass
        self._fail_everything(detail)

    async def wait_until_dead(self) -> str:
        """Wait (without polling) until the engine is dead or shut down; why."""
        if self._event_driven:
            self._attach_here()  # an idle engine's ranks are watched from now on too
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._dead_detail is not None:
                return self._dead_detail
            self._death_waiters.append(future)
        return await future

    @property
    def stopping(self) -> bool:
        """begin_shutdown() was called: a death that follows is the shutdown, not a failure."""
        return self._stop_requested

    def _fail_everything(self, detail: str) -> None:
        """End every in-flight and queued request with EngineDeadError (engine thread or after it stopped)."""
        with self._lock:
            if self._dead_detail is None:
                self._dead_detail = detail
        failures = []
        for stream in self._streams.values():
            failures.append((stream, EngineDeadError(f"the request was cut short: {detail}")))
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add) and not command.admitted.done():
                command.admitted.set_exception(EngineDeadError(f"the engine is not running: {detail}"))
            elif isinstance(command, _Call) and not command.done.done():
                command.done.set_exception(EngineDeadError(f"the engine is not running: {detail}"))
        self._post(failures)
