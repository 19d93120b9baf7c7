"""An answer's content blocks: streamed as Anthropic's block events (`BlockStream`), or whole (`content_blocks`).

Streamed, the blocks follow the model: a thinking block while it reasons, a text block while it answers, a
tool_use block per call, and a new block whenever the kind changes (so reasoning, text, reasoning gives three
blocks). Each block opens with `content_block_start`, grows by `content_block_delta` (text_delta, thinking_delta,
input_json_delta with the call's argument fragments) and ends with `content_block_stop`; a thinking block gets
its `signature_delta` just before it stops, as Anthropic sends it. Whole, the blocks are one thinking, one
text, then the calls.

Text that is only whitespace (the blank line between a model's reasoning and its call) opens no block: it waits
for the text that follows, and is dropped when a block of another kind comes first; a whole answer drops it too,
so streamed and whole answers agree.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable

from pydantic_core import from_json

from moe_runtime.server.messages.protocol import (THINKING_SIGNATURE, ContentBlock, TextBlock, ThinkingBlock,
                                                  ToolUseBlock)
from moe_runtime.server.protocol import AssistantMessage, DeltaToolCall
from moe_runtime.server.tool_calls.stream import StreamPiece


def tool_use_id() -> str:
    """Anthropic's call ids ("toolu_" and 24 characters): drawn here, whatever id the tool-call parser gave."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict:
    """A call's arguments as the `input` object. A forced call cut short by max_tokens has the arguments as far as
    they got: read as partial JSON, as Anthropic's client reads a streamed call's."""
    try:
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: AssistantMessage, thinking: bool) -> list[ContentBlock]:
    """A whole answer's blocks; `thinking`: its reasoning is shown (False: the client disabled thinking)."""
    blocks: list[ContentBlock] = []
    if thinking and message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content and message.content.strip():
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseBlock(id=tool_use_id(), name=call.function.name,
                                   input=tool_input(call.function.arguments)))
    return blocks


@dataclass
class OpenBlock:
    index: int
    kind: str                     # "thinking", "text" or "tool_use"
    call_index: int | None = None  # a tool_use block's call (the chat stream's tool-call index)


@dataclass
class BlockStream:
    """One answer's block events, from the reader's pieces (`server.chat_reading`)."""

    new_tool_use_id: Callable[[], str] = tool_use_id
    _open: OpenBlock | None = None
    _blocks: int = 0
    _held_whitespace: str = ""

    def events(self, piece: StreamPiece, thinking: bool) -> list[dict]:
        """The events of one piece; `thinking`: its reasoning is shown (False: dropped)."""
        events: list[dict] = []
        if piece.reasoning and thinking:
            self._grow("thinking", {"type": "thinking_delta", "thinking": piece.reasoning}, events)
        if piece.content:
            self._text(piece.content, events)
        for call in piece.tool_calls:
            self._tool_call(call, events)
        return events

    def close(self) -> list[dict]:
        """The last block's end (at the end of the answer)."""
        events: list[dict] = []
        self._close(events)
        return events

    def _text(self, text: str, events: list[dict]) -> None:
        if (self._open is None or self._open.kind != "text") and not (self._held_whitespace + text).strip():
            self._held_whitespace += text
            return
        text, self._held_whitespace = self._held_whitespace + text, ""
        self._grow("text", {"type": "text_delta", "text": text}, events)

    def _tool_call(self, call: DeltaToolCall, events: list[dict]) -> None:
        arguments = call.function.arguments if call.function is not None else None
        if call.id is not None:   # a call's first delta: its name is known
            name = call.function.name if call.function is not None else None
            self._start(OpenBlock(self._blocks, "tool_use", call.index),
                        {"type": "tool_use", "id": self.new_tool_use_id(), "name": name or "", "input": {}}, events)
        if not arguments or self._open is None or self._open.call_index != call.index:
            return   # nothing to add, or the fragment of a call whose block has closed: the stream keeps calls in order
        events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    def _grow(self, kind: str, delta: dict, events: list[dict]) -> None:
        """`delta` into the open block of `kind`, opening one first if the open block is of another kind."""
        if self._open is None or self._open.kind != kind:
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self._start(OpenBlock(self._blocks, kind), start, events)
        events.append(self._delta(delta))

    def _start(self, block: OpenBlock, content_block: dict, events: list[dict]) -> None:
        self._close(events)
        self._held_whitespace = ""   # whitespace before a block of another kind opens no block
        self._open, self._blocks = block, self._blocks + 1
        events.append({"type": "content_block_start", "index": block.index, "content_block": content_block})

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._open.index, "delta": delta}

    def _close(self, events: list[dict]) -> None:
        if self._open is None:
            return
        if self._open.kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        events.append({"type": "content_block_stop", "index": self._open.index})
        self._open = None
