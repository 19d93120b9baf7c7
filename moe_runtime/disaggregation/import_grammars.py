"""The grammars of a decode instance's imports, compiled off the stepping loop.

An imported request with structured output needs its grammar before it decodes: the decode rank
must accept the prefill's first token into a matcher of its own, then mask every later step.
Compiled on the stepping loop (as `add_import` once did), one slow grammar stalled every request of
every rank of the worker (lock-step) for as long as it compiled. So the compile starts when the
import is added, on the rank's grammar pool (`GrammarWaits.compile`: its threads, its cache, one
compile per spec, its `--grammar-compile-timeout`), and runs while the KV pull does. `DecodeImports`
holds back this rank's landed report (`KVImported`) until the grammar is ready too; then the request
gets its matcher and accepts the first token here. A compile that failed, one past its deadline,
or a first token the grammar refuses becomes the reported error, and the front fails that import
alone, as it does a failed pull. A compile ending, or a deadline passing, wakes the loop (`wake`),
as a pull ending does, so the report goes out without polling.

The ranks of a DP worker need no agreement of their own here (unlike `GrammarWaits`' requests,
which join each rank's scheduler): an import decodes only when the front's `ActivateImport` reaches
every rank, which it sends once every rank reported, grammar included.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass

from moe_runtime.records.sequence import Sequence
from moe_runtime.sampling.structured_output.grammar_state import GrammarState
from moe_runtime.sampling.structured_output.grammar_waits import Compiled, GrammarWaits
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec


@dataclass(eq=False)
class Compiling:
    seq: Sequence
    first_token: int
    compiled: concurrent.futures.Future       # of a `Compiled`
    deadline: float                           # time.monotonic()


class ImportGrammars:
    def __init__(self, waits: GrammarWaits):
        self.waits = waits
        self._compiling: dict[str, Compiling] = {}
        self._alarm: threading.Timer | None = None    # at the earliest deadline: wakes the loop

    def add(self, seq: Sequence, spec: StructuredOutputSpec, first_token: int) -> None:
        """Start compiling `seq`'s grammar (at a lock-step boundary); `seq.grammar` is set by `finish`."""
        self._compiling[seq.request_id] = Compiling(seq, first_token, self.waits.compile(spec),
                                                    time.monotonic() + self.waits.timeout_s)
        self._arm_alarm()

    def ready(self, request_id: str) -> bool:
        """Nothing to wait for: no grammar, or its compile ended, or its deadline passed."""
        entry = self._compiling.get(request_id)
        return entry is None or entry.compiled.done() or time.monotonic() >= entry.deadline

    def finish(self, request_id: str) -> str | None:
        """Once `ready`: give the request its grammar state and accept the prefill's first token. None, or
        why the request cannot go on (its compile failed or timed out, or the grammar refused the token)."""
        entry = self._compiling.pop(request_id, None)
        if entry is None:
            return None
        self._arm_alarm()
        if not entry.compiled.done():
            state = GrammarState.failed(self.waits.timeout_error())
        elif entry.compiled.cancelled():   # only when the pool shut down
            state = GrammarState.failed("structured output: the grammar compile was cancelled")
        else:
            compiled: Compiled = entry.compiled.result()
            state = compiled.new_state()
        self.waits.drop(entry.compiled)
        entry.seq.grammar = state
        return state.accept(entry.first_token)

    def forget(self, request_id: str) -> None:
        """Forget a request's grammar (its compile, if not started and nobody else wants it, is cancelled)."""
        entry = self._compiling.pop(request_id, None)
        if entry is not None:
            self.waits.drop(entry.compiled)
            self._arm_alarm()

    def _arm_alarm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if self._compiling:
            first = min(entry.deadline for entry in self._compiling.values())
            self._alarm = threading.Timer(max(first - time.monotonic(), 0.0) + 0.001, self.waits.wake)
            self._alarm.daemon = True
            self._alarm.start()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._compiling

    def __len__(self) -> int:
        return len(self._compiling)

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._compiling.clear()
