"""Drive the front (`Front`) from asyncio: request streams, the queue bound, death.

One driver: the front is attached to the running loop on first use. Requests (and the front's aborts,
`front.abort`) go straight to the engine core from the loop; the core's messages reach the loop as they arrive (the ranks'
ZeroMQ socket registered with the loop, or one hand-off per step from an in-process core's thread),
and outputs reach their streams in the same loop iteration. No polling.

When the engine dies every in-flight request ends with `EngineDeadError`, later submissions fail at
once, and `front.health()` says why: nothing waits forever on a dead engine. A request the engine failed on
its own (finish_reason "error") ends with `RequestFailedError`, for its caller only. A draining engine
(`begin_drain`, SIGTERM) refuses new submissions with `ShuttingDownError` and lets those in flight finish;
`wait_until_idle` says when none is left.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.errors import (EngineDeadError, MoERuntimeError, QueueFullError, RequestFailedError,
                                ShuttingDownError)
from moe_runtime.front.front import Front
from moe_runtime.front.async_admin import AsyncAdminCommands
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
    expert_load_refresh_s: float = 1.0   # how often the expert-load snapshot is refreshed while wanted
    offload_prompt_tokens: int = 4096    # a longer prompt's admission checks run in a worker thread, off the loop

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
    The last output has `finished=True`; an engine failure raises `EngineDeadError` instead (a stop the
    server asked for: `ShuttingDownError`), and a request the engine failed alone raises `RequestFailedError`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.loop = loop
        self.finished = False
        self.started = False                           # first output delivered (loop side)
        self.last_output: RequestOutput | None = None  # latest output delivered
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


class AsyncEngine(AsyncAdminCommands):
    """The front behind an asyncio face. Call `start()` once, `shutdown()` at the end.

    `front` is the `Front` itself (tests pass a double with the same methods), and the one object that answers
    the engine's request operations for every caller: the server calls `front.abort(id)` (the stream ends with
    its "abort" output before it returns), `front.health()` and `front.stats()` (kept current on the loop as the
    core's messages arrive); none of them is wrapped here. This class adds only what the loop needs: streams,
    the queue bound, drain and death (a death comes from the front, which keeps it for `health`; a stop this
    class was asked for is `stopping`, which the server's /health reads)."""

    def __init__(self, front: Front, config: AsyncEngineConfig = AsyncEngineConfig()):
        self.front = front
        self.config = config
        self.tokenizer = front.tokenizer
        self.max_model_len = front.max_model_len
        # the front checks specs at admission; the server parses them first, off the loop, in this cache
        self.structured_output_validator = front.limits.structured_output
        self._lock = threading.Lock()          # guards _dead_detail and _death_waiters (signal handlers, threads)
        self._dead_detail: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._unstarted = 0                    # submitted, no output yet
        self._expert_load = None
        self._expert_load_asked_at = float("-inf")   # monotonic start of the latest snapshot command
        self._stop_requested = False           # set by begin_shutdown (a plain store: signal-safe)
        self._loop: asyncio.AbstractEventLoop | None = None   # the loop the engine is attached to
        self._load_refresh: asyncio.Task | None = None
        self._death_waiters: list[asyncio.Future] = []
        self._draining = False                 # set by begin_drain (a plain store: signal-safe)
        self._idle_waiters: list[asyncio.Future] = []
        self._admin_lock: asyncio.Lock | None = None     # weight updates, sleep, wake: one after the other
        self._admission_resumes: asyncio.Event | None = None   # set while admission waits for an update's drain

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        """Ready to serve: the engine is attached to the loop of its first caller there (which may not run yet)."""
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Detach from the loop: in-flight requests end with `EngineDeadError`; then `front.shutdown()`."""
        self._detach(timeout_s)
        self._fail_everything("the server is shutting down")
        try:
            self.front.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway; say what went wrong
            logger.exception("front.shutdown() failed")

    def begin_drain(self) -> None:
        """Thread- and signal-safe: take no new request from now on (`ShuttingDownError`, which the server
        answers with 503 and Retry-After); the requests in flight carry on. `wait_until_idle` says when they
        have all ended; `begin_shutdown` then stops (and ends what still runs)."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    async def wait_until_idle(self) -> None:
        """Wait (without polling) until no request is in flight: every stream has ended and no submission is
        under way. Meant for a drain; requests admitted meanwhile are waited for too."""
        if self._is_idle():
            return
        future = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(future)
        await future

    @property
    def num_in_flight(self) -> int:
        """Requests admitted (or being admitted) that have not ended."""
        return len(self._streams) + max(0, self._unstarted - sum(not s.started for s in self._streams.values()))

    def _is_idle(self) -> bool:
        return not self._streams and self._unstarted == 0

    def _wake_if_idle(self) -> None:
        if self._idle_waiters and self._is_idle():
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                _resolve(waiter, None)

    def begin_shutdown(self) -> None:
        """Thread- and signal-safe: stop; in-flight requests end with an error."""
        self._stop_requested = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._die, "the server is shutting down")

    def _attach_here(self) -> None:
        """Attach the engine to the running loop, once."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.front.attach(self._deliver, self._die)
            self._refresh_load_soon()   # a first expert-load snapshot, for the first dashboard or /metrics read

    def _detach(self, timeout_s: float) -> None:
        """Stop the loop's readers (from the loop's thread or any other)."""
        loop = self._loop
        if loop is None:
            return
        if loop.is_closed() or not loop.is_running() or _running_loop() is loop:
            self.front.detach()
        else:
            asyncio.run_coroutine_threadsafe(self._detach_soon(), loop).result(timeout=timeout_s)

    async def _detach_soon(self) -> None:
        self.front.detach()
        await asyncio.sleep(0)  # let the cancelled readers unwind before the sockets close

    def _check_alive(self) -> None:
        if self._dead_detail is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead_detail}")

    # ---- event-loop API --------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     export_kv: bool = False, import_kv: KVHandle | None = None) -> RequestStream:
        """Admit a request; returns its output stream once the engine accepted it. `export_kv` / `import_kv`:
        a prefill / decode instance's half of a disaggregated request (see `Front.add_request`).

        Raises `InvalidRequestError` (the engine's validation), `QueueFullError`, `EngineDeadError`; the
        stream raises `EngineDeadError` or `RequestFailedError` if the request cannot finish. A long prompt's
        checks (limits, block hashes) run in a worker thread, so the loop keeps serving meanwhile. A refused
        `import_kv` request has its prefill instance free the parked KV at once (`Front.refuse_import`).
        """
        try:
            return await self._submit(request_id, prompt_token_ids, params, export_kv, import_kv)
        except BaseException:
            self.front.refuse_import(import_kv)
            raise

    async def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      export_kv: bool, import_kv: KVHandle | None) -> RequestStream:
        self._attach_here()
        self._admit_or_refuse()
        if self._admission_resumes is not None:   # an update drains the engine: admitted after it
            await self._admission_resumes.wait()
        stream = RequestStream(request_id, list(prompt_token_ids), asyncio.get_running_loop())
        try:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            prepare = functools.partial(self.front.prepare, request_id, stream.prompt_token_ids, params, export_kv,
                                        import_kv)
            if len(prompt_token_ids) > self.config.offload_prompt_tokens:
                admission = await asyncio.to_thread(prepare)
            else:
                admission = prepare()
            self._check_alive()
            if request_id in self._streams:   # another submit of the same id got there while this one waited
                raise ValueError(f"request id {request_id!r} is already in use")
            self.front.admit(admission)
        except BaseException:
            self._mark_started(stream)
            raise
        self._streams[request_id] = stream
        return stream

    def _admit_or_refuse(self) -> None:
        """Count a new request against max_queue; none while draining."""
        self._check_alive()
        if self._draining:
            raise ShuttingDownError("the server is shutting down and takes no new request; retry on another "
                                    "instance", self.config.retry_after_s)
        limit = self.config.max_queue
        if limit is not None and self._unstarted >= limit:
            raise QueueFullError(
                f"{self._unstarted} requests are already waiting for their first token "
                f"(--max-queue {limit}); retry later",
                self.config.retry_after_s,
            )
        self._unstarted += 1

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
                self.front.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Every DP worker forgets its cached KV blocks (blocks in use stay with their requests)."""
        self._check_alive()
        self.front.reset_prefix_cache()

    def expert_load(self):
        """The latest `ExpertLoadSnapshot`, or None. Taking one is a lock-step command across every rank, so
        it is refreshed in the background (at most every `expert_load_refresh_s`) while callers ask for it."""
        if _running_loop() is not None:
            self._attach_here()
            self._refresh_load_soon()
        return self._expert_load

    async def recent_expert_load(self, timeout_s: float = 10.0):
        """The cached snapshot while it is younger than `expert_load_refresh_s`; else the one refresh in flight
        (started here if none), which every concurrent caller awaits. However many callers (/metrics scrapes,
        /v1/expert_load), the ranks see at most one snapshot command per `expert_load_refresh_s`, and no
        caller's wait is longer than one snapshot (or `timeout_s`: then the cached one)."""
        self._attach_here()
        self._refresh_load_soon()
        refresh = self._load_refresh
        if refresh is not None and not refresh.done():
            try:   # shielded: a caller that gives up (a client gone) leaves the shared refresh running
                await asyncio.wait_for(asyncio.shield(refresh), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._expert_load

    def _refresh_load_soon(self) -> None:
        """Start a snapshot command unless one is in flight or the latest started under `expert_load_refresh_s`
        ago (counted from its start, so a failed or slow one does not make the next caller send another)."""
        stale = time.monotonic() - self._expert_load_asked_at >= self.config.expert_load_refresh_s
        if not stale or (self._load_refresh is not None and not self._load_refresh.done()) or self._dead_detail:
            return
        self._expert_load_asked_at = time.monotonic()
        try:
            future = self.front.expert_load()
        except MoERuntimeError:
            return
        if future.done() and future.exception() is None:   # answered at once (nothing to wait for)
            self._expert_load = future.result()
            return
        self._load_refresh = self._loop.create_task(self._await_load(future, timeout_s=10.0))

    async def _await_load(self, future, timeout_s: float):
        try:
            self._expert_load = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except (asyncio.TimeoutError, MoERuntimeError):
            pass
        return self._expert_load

    def rebalance_events(self) -> list | None:
        """The engine's `RebalanceEvent`s so far; None from an engine that keeps none (one without rebalancing)."""
        reader = getattr(self.front, "rebalance_events", None)
        return list(reader()) if reader is not None else None

    async def rebalance_now(self, timeout_s: float | None = None):
        """Plan a placement from the recorded window and migrate now; the engine's RebalanceEvent."""
        self._attach_here()
        self._check_alive()
        event = await asyncio.wait_for(asyncio.wrap_future(self.front.rebalance_now()), timeout_s)
        self._expert_load_asked_at = float("-inf")   # the placement moved: the next reader refreshes the snapshot
        return event

    async def fresh_expert_load(self, timeout_s: float = 10.0):
        """An expert-load snapshot taken now (between steps); the cached one if the engine is slow or gone."""
        self._attach_here()
        try:
            future = self.front.expert_load()
        except MoERuntimeError:
            return self._expert_load
        self._expert_load_asked_at = time.monotonic()
        return await self._await_load(future, timeout_s)

    @property
    def num_unstarted(self) -> int:
        """Requests submitted that have not produced their first output yet (the queue `max_queue` bounds)."""
        return self._unstarted

    # ---- outputs, on the loop ----------------------------------------------------------------------

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
        self._receive(items)

    def _receive(self, batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in batch:
            self._mark_started(stream)
            stream._put(item)
        self._wake_if_idle()   # the streams that ended here have left `_streams` already

    def _mark_started(self, stream: RequestStream) -> None:
        if not stream.started:
            stream.started = True
            self._unstarted -= 1
            self._wake_if_idle()   # a refused submission may have been the last one in flight

    def _die(self, detail: str) -> None:
        """The engine is gone (or shutting down): fail every stream and wake whoever waits for it."""
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
        self._attach_here()  # an idle engine's core is watched from now on too
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

    def _cut_short_error(self, detail: str) -> MoERuntimeError:
        if self._stop_requested:
            return ShuttingDownError("the server stopped before this request finished", self.config.retry_after_s)
        return EngineDeadError(f"the request was cut short: {detail}")

    def _fail_everything(self, detail: str) -> None:
        """End every in-flight request with EngineDeadError, or ShuttingDownError where the stop was asked for
        (`begin_shutdown`: a drain's time ran out, Ctrl-C), on its loop; from any thread."""
        with self._lock:
            if self._dead_detail is None:
                self._dead_detail = detail
        streams, self._streams = self._streams, {}
        running = _running_loop()
        for stream in streams.values():
            item = [(stream, self._cut_short_error(detail))]
            if stream.loop is running:
                self._receive(item)
                continue
            try:
                stream.loop.call_soon_threadsafe(self._receive, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                logger.debug("dropping the failure of %s for a closed event loop", stream.request_id)
