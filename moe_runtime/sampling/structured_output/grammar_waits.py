"""Requests waiting for their grammar: compiled on a thread pool, started at one agreed step boundary.

A grammar compiled on the stepping loop stalls every request of every DP worker (lock-step) while
`/health` says 200: the issue's 600-level schema held every stream 24.5 s. Here a request with
structured output is parked when it is added, its grammar compiles on a small thread pool
(xgrammar's C++ parser and compiler release the GIL, so the loop keeps stepping the others), and
the request joins the scheduler once its grammar is ready. A compile still running after
`timeout_s` fails its request alone ("did not compile within ..."); the pool thread is busy until
xgrammar returns (a C++ call cannot be interrupted), which the front's schema bounds keep short.

Why compile on each rank, and not once at the front with the result shipped to the ranks: xgrammar
can serialize a compiled grammar (`CompiledGrammar.serialize_json`), but the text holds the token
mask cache: 0.8 MB for a 50-level schema on a 512-token vocabulary, 37 MB for 400 levels, and it
grows with the vocabulary; sent to every rank of a worker over the control plane it would cost more
than compiling there. Every rank already holds the tokenizer's xgrammar view, so each compiles its
own copy (cached by spec), off its loop.

The ranks of one DP worker must schedule the same batches, so a request must start at the same step
on each. Each rank reports, for the first `AGREEMENT_WINDOW` waiting requests (its waiting list is
the same on every rank of the worker: it changes only by commands and by agreed starts), whether its
compile settled (compiled, or failed: the same spec fails alike everywhere) and whether its deadline
passed on this rank's clock. The lock-step loop agrees on these (`attention_dp.lockstep`): a request
settled on every rank starts with its grammar; one past its deadline on any rank that is not settled
on all fails on all with the timeout error; otherwise it waits. A one-rank core agrees with itself
(`local_view`). Requests beyond the window wait for a place in it (they compile meanwhile).

A P/D decode instance's imports wait elsewhere (`disaggregation.import_grammars`: the front's
activation, not this agreement, starts them) but compile here (`compile`/`drop`): same pool, cache,
in-flight compile per spec and timeout.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import xgrammar

from moe_runtime.errors import InvalidRequestError, error_message
from moe_runtime.sampling.structured_output.compiler import GrammarCompilerCache
from moe_runtime.sampling.structured_output.grammar_state import GrammarState
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec

logger = logging.getLogger(__name__)

AGREEMENT_WINDOW = 16      # waiting requests whose readiness one lock-step agreement carries, per DP worker
COMPILE_THREADS = 2        # grammars compiling at once on one rank


class WaitsForGrammar(Protocol):
    """What a waiting request is to this module: something that gets its grammar state (a `Sequence`)."""

    request_id: str
    grammar: GrammarState | None
    output_token_ids: list[int]    # tokens it has already (a resumed request): its grammar starts past them


@dataclass(frozen=True)
class Readiness:
    """One waiting request's state, as a rank sees it or (agreed) as every rank of its worker does."""

    settled: bool     # its compile ended (ok or failed); agreed: on every rank
    expired: bool     # its deadline passed before it settled; agreed: on some rank


@dataclass(frozen=True)
class Compiled:
    """A compile's outcome, shared by the requests that asked for the same spec meanwhile (each gets its own
    matcher from it)."""

    grammar: xgrammar.CompiledGrammar | None
    error: str | None = None

    def new_state(self) -> GrammarState:
        return GrammarState.start(self.grammar) if self.grammar is not None else GrammarState.failed(self.error)


@dataclass(eq=False)
class Waiting:
    request: WaitsForGrammar
    compiled: concurrent.futures.Future       # of a `Compiled`
    deadline: float                           # time.monotonic()


class GrammarWaits:
    def __init__(self, grammars: GrammarCompilerCache | None, timeout_s: float,
                 wake: Callable[[], None] = lambda: None, threads: int = COMPILE_THREADS):
        """`wake` is called (from a pool or timer thread) when a compile ended or a deadline passed."""
        self.grammars = grammars
        self.timeout_s = timeout_s
        self.wake = wake
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._waiting: OrderedDict[str, Waiting] = OrderedDict()    # in the order they were added
        self._compiling: dict[StructuredOutputSpec, concurrent.futures.Future] = {}   # one compile per spec
        self._alarm: threading.Timer | None = None                   # at the earliest deadline
        self._held: Counter[concurrent.futures.Future] = Counter()   # compiles waited for outside (`compile`)

    def add(self, request: WaitsForGrammar, spec: StructuredOutputSpec) -> None:
        """Park `request` and compile its grammar off the calling thread (a cached one is ready at once)."""
        compiled = self._compile_once(spec)
        self._waiting[request.request_id] = Waiting(request, compiled, time.monotonic() + self.timeout_s)
        self._arm_alarm()

    def compile(self, spec: StructuredOutputSpec) -> concurrent.futures.Future:
        """A future `Compiled` of `spec`, for a request that waits for it outside this class (a P/D import);
        `wake` is called when it ends. Hand it back with `drop` once read or no longer wanted."""
        compiled = self._compile_once(spec)
        self._held[compiled] += 1
        return compiled

    def drop(self, compiled: concurrent.futures.Future) -> None:
        """One holder of a `compile` is done with it: a compile nobody waits for any more and not started yet
        is cancelled."""
        self._held[compiled] -= 1
        if self._held[compiled] <= 0:
            del self._held[compiled]
            if not any(waiting.compiled is compiled for waiting in self._waiting.values()):
                compiled.cancel()

    def timeout_error(self) -> str:
        return (f"structured output: the grammar did not compile within {self.timeout_s:g}s "
                f"(--grammar-compile-timeout); a smaller or simpler schema, regex or grammar compiles faster")

    def _compile_once(self, spec: StructuredOutputSpec) -> concurrent.futures.Future:
        """The running compile of `spec`, or a new one (a cached grammar is then a lookup)."""
        self._compiling = {s: compiled for s, compiled in self._compiling.items() if not compiled.done()}
        compiled = self._compiling.get(spec)
        if compiled is None:
            compiled = self._compiling[spec] = self._pool.submit(self._compile, spec)
            compiled.add_done_callback(lambda _: self.wake())
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> Compiled:
        """On a pool thread; never raises (a failure fails the requests that wait for it, alone)."""
        if self.grammars is None:
            return Compiled(None, "structured output is unavailable on this engine (no tokenizer xgrammar can read)")
        try:
            return Compiled(self.grammars.compile(spec))
        except Exception as exc:  # noqa: BLE001 - fails the waiting requests only, at their first step
            logger.warning("structured output for a request could not be compiled: %s", error_message(exc))
            return Compiled(None, str(exc) if isinstance(exc, InvalidRequestError) else error_message(exc))

    def local_view(self) -> list[Readiness]:
        """This rank's readiness of the first `AGREEMENT_WINDOW` waiting requests, in order."""
        now = time.monotonic()
        view = []
        for waiting in list(self._waiting.values())[:AGREEMENT_WINDOW]:
            settled = waiting.compiled.done()
            view.append(Readiness(settled, not settled and now >= waiting.deadline))
        return view

    def start(self, agreed: list[Readiness]) -> list[WaitsForGrammar]:
        """Apply the agreement on the first waiting requests (`agreed[i]` for the i-th): those it settles get
        their grammar state (or the timeout's failed one) and are returned, in order, to be scheduled."""
        decided = []
        for waiting, verdict in zip(list(self._waiting.values()), agreed):
            if verdict.settled:
                waiting.request.grammar = _past(waiting.compiled.result().new_state(),
                                                waiting.request.output_token_ids)
            elif verdict.expired:
                self._cancel_unshared(waiting)
                waiting.request.grammar = GrammarState.failed(self.timeout_error())
            else:
                continue
            decided.append(waiting.request)
        for request in decided:
            del self._waiting[request.request_id]
        self._compiling = {spec: compiled for spec, compiled in self._compiling.items() if not compiled.done()}
        self._arm_alarm()
        return decided

    def forget(self, request_id: str) -> WaitsForGrammar | None:
        """Forget a waiting request (its compile, if running, ends unused). The request, or None."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is None:
            return None
        self._cancel_unshared(waiting)
        self._arm_alarm()
        return waiting.request

    def _cancel_unshared(self, gone: Waiting) -> None:
        """Drop a compile that has not started, unless another waiting request (or a `compile` holder) shares it."""
        if gone.compiled in self._held:
            return
        if not any(other.compiled is gone.compiled for other in self._waiting.values() if other is not gone):
            gone.compiled.cancel()

    def _arm_alarm(self) -> None:
        """One timer at the earliest deadline, so an idle loop that waits for a wake hears of it (no polling)."""
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if self._waiting:
            first = next(iter(self._waiting.values()))
            self._alarm = threading.Timer(max(first.deadline - time.monotonic(), 0.0) + 0.001, self.wake)
            self._alarm.daemon = True
            self._alarm.start()

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._waiting.clear()
        self._held.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _past(state: GrammarState, tokens: list[int]) -> GrammarState:
    """`state` advanced past the tokens a resumed request already has (failed if one does not continue it)."""
    for token in tokens:
        error = state.accept(token)
        if error is not None:
            return GrammarState.failed(error)
    return state
