"""One choice's text as content and OpenAI tool-call deltas, as it grows (`ToolCallStream`) or whole
(`read_message`).

Streamed, a call is announced once its name is complete (index, id, type, function name), then its
arguments follow as fragments that concatenate to the JSON text the model wrote. Content before the
tool-call section streams as it comes, except a tail that may still turn into the section's marker.
A whole response goes through the same stream, so the two never disagree; it falls back to plain
content (no calls) when a call is malformed or incomplete, as a client cannot use half a call.

Each update rescans only the call in progress (calls are short), and the calls of one choice are
capped (`max_calls`).

A forced answer (`tool_choice` required or named: `only_calls`) is the calls and nothing else: its
text is the internal JSON array, never content. Cut short (max_tokens), it shows the calls as far as
they got, streamed and whole alike, and the finish reason ("length") tells the client they are cut.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from moe_runtime.server.tool_calls.json_scan import NotJson, is_json_object
from moe_runtime.server.tool_calls.parser import ToolCallParser

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


@dataclass
class ToolCallStream:
    parser: ToolCallParser
    max_calls: int
    only_calls: bool = False          # a forced answer: the text is never content, even when the calls break off
    text: str = ""
    calls: list[SentCall] = field(default_factory=list)
    malformed: bool = False           # a call went wrong after some were sent: the rest is dropped
    _content_sent: int = 0
    _section: int | None = None       # where the tool-call section starts, once found
    _plain: bool = False              # the section was not tool calls after all: all text is content
    _call_pos: int = 0                # where the call in progress starts

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> StreamPiece:
        """The rest, once the text is complete (nothing held back any more)."""
        return self._advance(final=True)

    @property
    def called(self) -> bool:
        """True once a call has been announced."""
        return bool(self.calls)

    def _advance(self, final: bool) -> StreamPiece:
        piece = StreamPiece()
        if self._section is None and not self._plain:
            start = self.parser.find_start(self.text, final)
            if start.index is None:
                self._send_content(piece, len(self.text) - (0 if final else start.held))
                return piece
            self._send_content(piece, start.index)
            self._section = self._call_pos = start.index
        if self._plain:
            self._send_content(piece, len(self.text))
            return piece
        self._scan_calls(piece, final)
        return piece

    def _send_content(self, piece: StreamPiece, upto: int) -> None:
        if upto > self._content_sent:
            piece.content += self.text[self._content_sent:upto]
            self._content_sent = upto

    def _scan_calls(self, piece: StreamPiece, final: bool) -> None:
        while not self.malformed and len(self._complete_calls()) < self.max_calls:
            try:
                scan = self.parser.scan_call(self.text, self._call_pos, final)
            except NotJson:
                self._give_up(piece)
                return
            if scan is None or (scan.name is None and scan.end is None):
                return   # no further call, or nothing to announce yet
            if scan.name is None:   # a complete call without a name
                self._give_up(piece)
                return
            if not self.calls or self.calls[-1].complete:
                self.calls.append(SentCall(self.parser.new_call_id()))
            index, call = len(self.calls) - 1, self.calls[-1]
            if call.name is None:
                call.name = scan.name
                piece.tool_calls.append(DeltaToolCall(index=index, id=call.id, type="function",
                                                      function=DeltaFunctionCall(name=scan.name, arguments="")))
            arguments = scan.arguments or (NO_ARGUMENTS if scan.end is not None else "")
            if not arguments.startswith(call.arguments):   # sent fragments cannot be taken back
                self.malformed = True
                return
            if len(arguments) > len(call.arguments):
                piece.tool_calls.append(DeltaToolCall(
                    index=index, function=DeltaFunctionCall(arguments=arguments[len(call.arguments):])))
                call.arguments = arguments
            if scan.end is None:
                return
            call.complete = True
            self._call_pos = scan.end

    def _complete_calls(self) -> list[SentCall]:
        return [call for call in self.calls if call.complete]

    def _give_up(self, piece: StreamPiece) -> None:
        """The text is not (or no longer) this format's calls: before any call was sent, it was all content;
        after, the rest is dropped (a forced answer's text is never content)."""
        if self.calls or self.only_calls:
            self.malformed = True
            return
        self._plain = True
        self._send_content(piece, len(self.text))


@dataclass(frozen=True)
class ReadMessage:
    """A whole answer read for tool calls: content (None when empty) and the calls (empty when none)."""

    content: str | None
    tool_calls: list[ToolCall]


def read_message(parser: ToolCallParser, max_calls: int, text: str, only_calls: bool = False) -> ReadMessage:
    """`text` through a `ToolCallStream`; calls only if every one is complete with a JSON object as arguments
    (otherwise the whole text is the content, as vLLM answers). With `only_calls` (a forced answer) the calls
    as far as the text has them, and no content."""
    stream = ToolCallStream(parser, max_calls, only_calls)
    piece = stream.feed(text)
    piece.extend(stream.finish())
    calls = stream.calls
    if only_calls:
        return ReadMessage(None, [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                                  for call in calls])
    usable = calls and not stream.malformed and all(call.complete and is_json_object(call.arguments)
                                                    for call in calls)
    if not usable:
        return ReadMessage(text or None, [])
    content = piece.content if piece.content.strip() else None
    return ReadMessage(content, [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                                 for call in calls])
