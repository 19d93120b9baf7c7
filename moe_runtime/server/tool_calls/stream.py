"""One choice's text as content and OpenAI tool calls, as it grows (`ToolCallStream`) or whole (`read_message`),
sending only calls that pass the request's check (`server.tool_calls.call_check`).

The text is read in up to three parts:

1. Content, until the parser finds where its tool-call section starts. It streams as it comes, except a tail
   that may still turn into the section's marker (held back, not streamed yet).
2. Calls, one after another. Each is held until it is complete, then checked: a call whose name is offered
   and whose arguments validate is sent whole (its announcement - index, id, type, name - then its arguments in
   one delta), so a client never receives a call that is later found broken. Sent calls cannot be taken back.
3. After the calls, one of:
   - the call in progress cannot be sent (its text is not this format's call, it does not pass the check, or
     the text ends before it is complete): from that call's first character on, the rest of the text is
     content, streamed as it comes. So nothing the model wrote is lost, a call that was not sent shows as the
     text it was, and with no call sent at all the whole answer is content;
   - the section ends (what follows is not a further call: text after the last call) or `max_calls` calls are
     sent (`parallel_tool_calls` false: one): the rest is not shown (`dropped_text`), as vLLM's parsers drop it.

A whole response goes through the same stream, so the two never disagree: the same calls (ids apart) and the
same content, except that a whole answer with calls gives blank content as null, as OpenAI's do. A forced answer
(`tool_choice` required or named) reads differently: `server.tool_calls.forced_stream`.

Parsers keep no state, so an update rescans the call in progress from its start. Most calls are short and are
rescanned on every update; a long one (a file's content as an argument) only once the text has grown by a
fraction of it since its last scan, so reading it costs a few times its length rather than its length squared
(the update that completes it may then be noticed a little later, at the latest when the text is complete).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.tool_calls.call_check import ANY_OBJECT_ARGUMENTS, CallCheck
from moe_runtime.server.tool_calls.forced_stream import read_forced
from moe_runtime.server.tool_calls.json_scan import NotJson
from moe_runtime.server.tool_calls.parser import CallScan, ToolCallParser
from moe_runtime.server.tool_calls.stream_piece import (NO_ARGUMENTS, ReadMessage, SentCall, StreamPiece,
                                                        whole_call)

__all__ = ["NO_ARGUMENTS", "ReadMessage", "StreamPiece", "ToolCallStream", "read_message"]

CONTENT, CALLS, REST_IS_CONTENT, REST_DROPPED = "content", "calls", "rest is content", "rest dropped"
RESCAN_ALWAYS = 512   # a call in progress up to this long is rescanned on every update
RESCAN_GROWTH = 8     # a longer one once the text has grown by 1/RESCAN_GROWTH of it since its last scan


@dataclass
class ToolCallStream:
    parser: ToolCallParser
    max_calls: int
    check: CallCheck = ANY_OBJECT_ARGUMENTS
    text: str = ""
    calls: list[SentCall] = field(default_factory=list)
    section_start: int | None = None   # where the tool-call section starts, once found
    calls_end: int = 0                 # the end of the last call sent (where the call in progress starts)
    _part: str = CONTENT               # which part of the text is being read (the module's docstring)
    _content_sent: int = 0
    _last_scan: tuple[int, int] = (-1, 0)   # (where the call scanned starts, how long the text was)

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> StreamPiece:
        """The rest, once the text is complete (nothing held back any more)."""
        return self._advance(final=True)

    @property
    def called(self) -> bool:
        """True once a call has been sent."""
        return bool(self.calls)

    @property
    def calls_text(self) -> str:
        """The text of the calls sent, as the model wrote it."""
        return "" if self.section_start is None else self.text[self.section_start:self.calls_end]

    @property
    def dropped_text(self) -> str:
        """The text after the calls that is not shown (neither content nor calls)."""
        return self.text[self.calls_end:] if self._part == REST_DROPPED else ""

    def _advance(self, final: bool) -> StreamPiece:
        piece = StreamPiece()
        if self._part == CONTENT:
            start = self.parser.find_start(self.text, final)
            if start.index is None:
                self._send_content(piece, len(self.text) - (0 if final else start.held))
                return piece
            self._send_content(piece, start.index)
            self.section_start = self.calls_end = start.index
            self._part = CALLS
        if self._part == CALLS:
            self._read_calls(piece, final)
        if self._part == REST_IS_CONTENT:
            self._send_content(piece, len(self.text))
        return piece

    def _send_content(self, piece: StreamPiece, upto: int) -> None:
        if upto > self._content_sent:
            piece.content += self.text[self._content_sent:upto]
            self._content_sent = upto

    def _read_calls(self, piece: StreamPiece, final: bool) -> None:
        while self._part == CALLS:
            if len(self.calls) >= self.max_calls:
                self._part = REST_DROPPED
                return
            if not final and not self._worth_rescanning():
                return
            self._last_scan = (self.calls_end, len(self.text))
            try:
                scan = self.parser.scan_call(self.text, self.calls_end, final)
            except NotJson:
                self._rest_is_content()
                return
            if scan is None:   # no further call here: the section is over (or never held one)
                self._part = REST_DROPPED if self.calls else REST_IS_CONTENT
                self._content_sent = self.calls_end
                return
            if scan.end is None:   # the call is not complete yet
                if final:
                    self._rest_is_content()
                return
            arguments = scan.arguments or NO_ARGUMENTS
            if scan.name is None or not self.check.accepts(scan.name, arguments):
                self._rest_is_content()
                return
            self._send_call(piece, scan, arguments)

    def _worth_rescanning(self) -> bool:
        """Whether the call in progress is to be scanned again now (the module's docstring)."""
        in_progress = len(self.text) - self.calls_end
        start, scanned = self._last_scan
        grown = len(self.text) - scanned
        return start != self.calls_end or in_progress <= RESCAN_ALWAYS or grown * RESCAN_GROWTH >= in_progress

    def _send_call(self, piece: StreamPiece, scan: CallScan, arguments: str) -> None:
        index = len(self.calls)
        call = SentCall(self._call_id(scan, index), scan.name, arguments, complete=True)
        self.calls.append(call)
        piece.tool_calls += whole_call(index, call)
        self.calls_end = scan.end

    def _call_id(self, scan: CallScan, index: int) -> str:
        """The id the model wrote, else a fresh one; unique within the answer (a client matches each result to
        its call by id)."""
        used = {call.id for call in self.calls}
        if scan.call_id is not None and scan.call_id not in used:
            return scan.call_id
        candidate = index
        while (call_id := self.parser.new_call_id(scan.name, candidate)) in used:
            candidate += 1
        return call_id

    def _rest_is_content(self) -> None:
        """The call in progress cannot be sent: from its first character on, the text is content."""
        self._part = REST_IS_CONTENT
        self._content_sent = self.calls_end


def read_message(parser: ToolCallParser, max_calls: int, text: str, only_calls: bool = False,
                 check: CallCheck = ANY_OBJECT_ARGUMENTS) -> ReadMessage:
    """`text` through a `ToolCallStream`: the calls it sends and its content (null when empty, or blank with
    calls). With `only_calls` (a forced answer) the calls as far as the text has them, and no content."""
    if only_calls:
        return read_forced(parser, max_calls, text)
    stream = ToolCallStream(parser, max_calls, check)
    piece = stream.feed(text)
    piece.extend(stream.finish())
    content = piece.content if piece.content.strip() or not stream.calls else ""
    return ReadMessage(content or None, [call.as_tool_call() for call in stream.calls])
