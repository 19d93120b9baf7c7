"""A Responses answer, whole or streamed (`ResponsesFormatter`, the `AnswerFormatter` of `server.responding`).

Both run the choice's text through the same streaming reader (`server.chat_reading`) into the same items
(`output_items`): a whole answer is the stream with nobody listening. A choice cut by `max_output_tokens` is
`incomplete` (`incomplete_details.reason`), as OpenAI answers, and its stream ends in `response.incomplete`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from moe_runtime.server.chat_reading import ChatReading, ChoiceReader
from moe_runtime.server.errors import APIError
from moe_runtime.server.generation import ChoiceEvent, Generation
from moe_runtime.server.responses.events import ItemEventLog
from moe_runtime.server.responses.output_items import OutputItem, OutputItems

Finished = Callable[[dict, list[OutputItem]], None]   # the final body and its items (to store them)


def usage(generation: Generation, reasoning_tokens: int) -> dict:
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": generation.cached_prompt_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


@dataclass
class ResponsesFormatter:
    generation: Generation
    response_id: str
    model_name: str
    settings: dict                              # the request's settings a response echoes (`routes.echoed_settings`)
    reading: ChatReading
    count_tokens: Callable[[str], int]          # a text's token count (the reasoning's, for usage)
    finished: Finished | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    _log: ItemEventLog = field(default_factory=ItemEventLog)
    _items: OutputItems = field(default_factory=OutputItems)
    _reader: ChoiceReader | None = None
    _final: dict | None = None

    def shell(self, status: str) -> dict:
        """The response's body without its output: what `response.created` carries."""
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model_name, "output": [], "error": None, "incomplete_details": None, "usage": None,
                **self.settings}

    # streaming
    def opening(self) -> list[dict]:
        self._items.listener = self._log
        self._log.event("response.created", response=self.shell("in_progress"))
        self._log.event("response.in_progress", response=self.shell("in_progress"))
        return self._log.take()

    def chunks(self, event: ChoiceEvent) -> list[dict]:
        self.add(event)
        return self._log.take()

    def closing(self) -> list[dict]:
        body = self.response()
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        self._log.event(kind, response=body)
        return self._log.take()

    def failure(self, error: APIError) -> list[dict]:
        self._log.event("error", code=error.code or error.type, message=error.message, param=error.param)
        return self._log.take()

    # whole (the same reading, nobody listening)
    def add(self, event: ChoiceEvent) -> None:
        if self._reader is None:
            self._reader = self.reading.choice()
        piece = self._reader.feed(event.delta)
        if event.delta.finish_reason is not None:
            piece.extend(self._reader.finish())
        self._items.add(piece)
        if event.delta.finish_reason is not None:
            self._items.finish()

    def response(self) -> dict:
        if self._final is not None:
            return self._final
        self._items.finish()
        tracker = next(iter(self.generation.trackers.values()), None)
        cut = tracker is not None and tracker.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        reasoning = "".join(item.text for item in self._items.items if item.kind == "reasoning")
        body = self.shell(status)
        body.update(output=[item.body(status) for item in self._items.items], completed_at=int(time.time()),
                    usage=usage(self.generation, self.count_tokens(reasoning) if reasoning else 0),
                    incomplete_details={"reason": "max_output_tokens"} if cut else None)
        self._final = body
        if self.finished is not None:
            self.finished(body, self._items.items)
        return body

    def error_body(self, error: APIError) -> dict:
        return error.body()
