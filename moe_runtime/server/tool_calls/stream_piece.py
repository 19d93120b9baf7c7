"""What reading a choice's text hands out: per update a `StreamPiece` (content, tool-call deltas, reasoning), the
calls sent so far (`SentCall`), and for a whole answer a `ReadMessage`. Shared by the tool-call streams
(`server.tool_calls.stream`, `server.tool_calls.forced_stream`) and harmony's (`server.harmony_parse`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

NO_ARGUMENTS = "{}"   # what a complete call that wrote no arguments is given


@dataclass
class StreamPiece:
    """What one update adds: content text and tool-call deltas (and reasoning, where a reasoning parser or
    harmony split it off: `server.chat_reading`)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    reasoning: str = ""

    def extend(self, other: "StreamPiece") -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls
        self.reasoning += other.reasoning


@dataclass
class SentCall:
    """What the client has been sent of one call."""

    id: str
    name: str | None = None
    arguments: str = ""
    complete: bool = False

    def as_tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))


def announcement(index: int, call_id: str, name: str) -> DeltaToolCall:
    """A call's first delta: index, id, type and name (its arguments follow in later deltas, as OpenAI's do)."""
    return DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=""))


def arguments_delta(index: int, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))


def whole_call(index: int, call: SentCall) -> list[DeltaToolCall]:
    """A complete call's deltas: its announcement, then its arguments in one piece."""
    return [announcement(index, call.id, call.name), arguments_delta(index, call.arguments)]


@dataclass(frozen=True)
class ReadMessage:
    """A whole answer read for tool calls: content (None when empty) and the calls (empty when none)."""

    content: str | None
    tool_calls: list[ToolCall]
