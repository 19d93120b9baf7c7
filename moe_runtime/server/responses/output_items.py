"""A Responses answer's output items, built from the chat reader's pieces as they arrive (`OutputItems`).

One choice's pieces (reasoning text, content text, tool-call deltas: `server.tool_calls.stream.StreamPiece`)
become items in the order the model wrote them: a reasoning item, a message with one `output_text` part, a
`function_call` per call; a new item opens whenever the kind changes. Each change is told to a listener as
the Responses stream's events (`ItemEvents`), and a whole answer is the same items with no listener, so the
streamed and the whole answer cannot differ.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol

from moe_runtime.server.tool_calls.stream import StreamPiece


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItem:
    kind: str                    # "reasoning" | "message" | "function_call"
    id: str
    text: str = ""               # reasoning or message text; a call's arguments
    name: str | None = None      # function_call: the function's name
    call_id: str | None = None   # function_call: the id a function_call_output answers
    done: bool = False

    def body(self, status: str) -> dict:
        if self.kind == "message":
            return {"type": "message", "id": self.id, "role": "assistant", "status": status,
                    "content": [output_text(self.text)] if self.done or self.text else []}
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "status": status, "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ItemEvents(Protocol):
    """What the stream tells its client as items grow (`server.responses.events`)."""

    def opened(self, index: int, item: OutputItem) -> None: ...

    def grew(self, index: int, item: OutputItem, delta: str) -> None: ...

    def closed(self, index: int, item: OutputItem) -> None: ...


@dataclass
class OutputItems:
    listener: ItemEvents | None = None
    items: list[OutputItem] = field(default_factory=list)
    _calls: dict[int, int] = field(default_factory=dict)   # a tool-call delta's index -> its item's index

    def add(self, piece: StreamPiece) -> None:
        if piece.reasoning:
            self._grow("reasoning", piece.reasoning)
        if piece.content:
            self._grow("message", piece.content)
        for delta in piece.tool_calls:
            position = self._calls.get(delta.index)
            if position is None:
                self._close_current()
                call = OutputItem("function_call", item_id("fc"), name=delta.function.name if delta.function else None,
                                  call_id=delta.id)
                position = self._calls[delta.index] = self._open(call)
            fragment = (delta.function.arguments or "") if delta.function is not None else ""
            if fragment:
                item = self.items[position]
                item.text += fragment
                if self.listener is not None:
                    self.listener.grew(position, item, fragment)

    def finish(self) -> None:
        self._close_current()

    def _grow(self, kind: str, text: str) -> None:
        current = self.items[-1] if self.items and not self.items[-1].done else None
        if current is None or current.kind != kind:
            self._close_current()
            prefix = "msg" if kind == "message" else "rs"
            self._open(OutputItem(kind, item_id(prefix)))
            current = self.items[-1]
        current.text += text
        if self.listener is not None:
            self.listener.grew(len(self.items) - 1, current, text)

    def _open(self, item: OutputItem) -> int:
        self.items.append(item)
        if self.listener is not None:
            self.listener.opened(len(self.items) - 1, item)
        return len(self.items) - 1

    def _close_current(self) -> None:
        if self.items and not self.items[-1].done:
            self.items[-1].done = True
            if self.listener is not None:
                self.listener.closed(len(self.items) - 1, self.items[-1])
