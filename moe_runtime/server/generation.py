"""The engine requests behind one API call: one per choice (n choices x prompts), their merged events.

`Generation` submits every choice, yields `ChoiceEvent`s in arrival order, records TTFT / ITL /
end-to-end latency, and on `close()` aborts whatever has not finished (client gone, error), so
the KV blocks of an abandoned request are freed at the next engine step. A choice the engine
failed (`RequestFailedError`) fails the whole API call: its other choices are aborted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from moe_runtime.front.async_engine import AsyncEngine, RequestFailedError, RequestStream
from moe_runtime.disaggregation.kv_transfer.handle import KVHandle
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.deltas import ChoiceDelta, ChoiceTracker
from moe_runtime.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class ChoiceSpec:
    index: int                  # the choice's index in the response
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""       # what an echo shows of the prompt (completions with echo=true; else unused)
    export_kv: bool = False     # prefill instance: park the prompt's KV, answer with its handle
    import_kv: KVHandle | None = None   # decode instance: the prompt was prefilled there


@dataclass
class ChoiceEvent:
    index: int
    delta: ChoiceDelta


@dataclass
class Generation:
    async_engine: AsyncEngine
    request_id: str
    choices: list[ChoiceSpec]
    metrics: ServerMetrics
    arrival: float = field(default_factory=time.perf_counter)
    trackers: dict[int, ChoiceTracker] = field(default_factory=dict)
    _streams: dict[int, RequestStream] = field(default_factory=dict)
    _timed_tokens: dict[int, int] = field(default_factory=dict)   # tokens whose latency is recorded
    _pumps: list[asyncio.Task] = field(default_factory=list)
    _closed: bool = False

    async def start(self) -> None:
        """Submit every choice; if one is refused, abort the others and re-raise."""
        try:
            for spec in self.choices:
                stream = await self.async_engine.submit(f"{self.request_id}-{spec.index}", spec.prompt_token_ids,
                                                        spec.params, export_kv=spec.export_kv,
                                                        import_kv=spec.import_kv)
                self._streams[spec.index] = stream
                self.trackers[spec.index] = ChoiceTracker()
        except BaseException:
            self.close()
            raise

    @property
    def prompt_tokens(self) -> int:
        """Each distinct prompt counts once, however many choices it has (as OpenAI counts)."""
        return self._per_prompt(lambda spec: len(spec.prompt_token_ids))

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each distinct prompt counted once (its first choice's count)."""
        return self._per_prompt(lambda spec: self.trackers[spec.index].cached_prompt_tokens
                                if spec.index in self.trackers else 0)

    def _per_prompt(self, count) -> int:
        """The sum of `count(spec)` over the distinct prompts, each taken from its first choice."""
        first: dict[int, int] = {}
        for spec in self.choices:
            first.setdefault(spec.prompt_index, count(spec))
        return sum(first.values())

    @property
    def completion_tokens(self) -> int:
        return sum(tracker.num_tokens for tracker in self.trackers.values())

    def kv_transfer_params(self) -> dict | None:
        """A prefill instance's answer: the handle of the (one) choice whose KV it parked."""
        handles = [tracker.kv_handle for tracker in self.trackers.values() if tracker.kv_handle is not None]
        return handles[0].to_json_object() if handles else None

    @property
    def finished(self) -> bool:
        return all(stream.finished for stream in self._streams.values())

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's deltas until all have finished; raises what a stream raised (EngineDeadError,
        RequestFailedError)."""
        try:
            async for event in self._merged_events():
                yield event
        except RequestFailedError:
            self.metrics.finish_reasons.inc("error")
            raise

    async def _merged_events(self) -> AsyncIterator[ChoiceEvent]:
        if len(self._streams) == 1:
            (index, stream), = self._streams.items()
            async for output in stream:
                yield self._event(index, output)
            return
        merged: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(index, stream, merged))
                       for index, stream in self._streams.items()]
        remaining = len(self._pumps)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield self._event(index, item)

    def close(self) -> None:
        """Abort every unfinished choice and stop the pumps (safe to call more than once)."""
        if self._closed:
            return
        self._closed = True
        if self._streams:
            self._log_outcome()
        for task in self._pumps:
            task.cancel()
        for stream in self._streams.values():
            if not stream.finished:
                self.async_engine.front.abort(stream.request_id)
                self.metrics.finish_reasons.inc("abort")

    def _log_outcome(self) -> None:
        """One info line per API call, as it ends: what a person watching the server wants to see scroll by."""
        reasons = sorted({self._outcome_of(index) for index in self._streams})
        logger.info("request %s: %s, %d prompt + %d completion tokens, %.3f s", self.request_id, "/".join(reasons),
                    self.prompt_tokens, self.completion_tokens, time.perf_counter() - self.arrival)

    def _outcome_of(self, index: int) -> str:
        """The choice's finish reason; one that ended without one failed ("error"), an unfinished one is aborted."""
        finish_reason = self.trackers[index].finish_reason
        if finish_reason is not None:
            return finish_reason
        return "error" if self._streams[index].finished else "abort"

    @staticmethod
    async def _pump(index: int, stream: RequestStream, merged: asyncio.Queue) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            merged.put_nowait((index, exc))
            return
        merged.put_nowait((index, None))

    def _event(self, index: int, output) -> ChoiceEvent:
        delta = self.trackers[index].advance(output)
        self._record_timing(index, delta.finish_reason)
        return ChoiceEvent(index, delta)

    def _record_timing(self, index: int, finish_reason: str | None) -> None:
        """TTFT and inter-token gaps from the times tokens reached the event loop (exact even when merged)."""
        times = self._streams[index].token_times
        seen = self._timed_tokens.get(index, 0)
        if times and seen == 0:
            self.metrics.ttft.observe(times[0] - self.arrival)
            seen = 1
        for i in range(max(seen, 1), len(times)):
            self.metrics.itl.observe(times[i] - times[i - 1])
        self._timed_tokens[index] = len(times)
        if finish_reason is not None:
            self.metrics.finish_reasons.inc(finish_reason)
            if finish_reason != "abort" and times:
                self.metrics.e2e.observe(times[-1] - self.arrival)
