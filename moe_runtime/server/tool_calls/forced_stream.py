"""A forced answer's calls as they grow (`ForcedCallStream`), or whole (`read_forced`).

With `tool_choice` required or named the answer is the internal JSON array of calls and nothing else (structured
output holds it to the tools' schemas from the first token), so it is never content and its calls need no check:
a call is announced once its name is complete, then its arguments follow as fragments that concatenate to the
JSON text the model wrote. Cut short (max_tokens), the answer shows the calls as far as they got, streamed and
whole alike, and the finish reason ("length") tells the client they are cut.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.tool_calls.json_scan import NotJson
from moe_runtime.server.tool_calls.parser import ToolCallParser
from moe_runtime.server.tool_calls.stream_piece import (NO_ARGUMENTS, ReadMessage, SentCall, StreamPiece,
                                                        announcement, arguments_delta)


@dataclass
class ForcedCallStream:
    parser: ToolCallParser
    max_calls: int
    text: str = ""
    calls: list[SentCall] = field(default_factory=list)
    malformed: bool = False   # the text stopped being calls (only a cut can do that): nothing more is read
    _call_pos: int = 0        # where the call in progress starts

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> StreamPiece:
        return self._advance(final=True)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _advance(self, final: bool) -> StreamPiece:
        piece = StreamPiece()
        while not self.malformed and sum(call.complete for call in self.calls) < self.max_calls:
            try:
                scan = self.parser.scan_call(self.text, self._call_pos, final)
            except NotJson:
                self.malformed = True
                break
            if scan is None or (scan.name is None and scan.end is None):
                break   # no further call, or nothing to announce yet
            if scan.name is None:   # a complete call without a name
                self.malformed = True
                break
            if not self.calls or self.calls[-1].complete:
                index = len(self.calls)
                self.calls.append(SentCall(self.parser.new_call_id(scan.name, index), scan.name))
                piece.tool_calls.append(announcement(index, self.calls[-1].id, scan.name))
            index, call = len(self.calls) - 1, self.calls[-1]
            arguments = scan.arguments or (NO_ARGUMENTS if scan.end is not None else "")
            if not arguments.startswith(call.arguments):   # sent fragments cannot be taken back
                self.malformed = True
                break
            if len(arguments) > len(call.arguments):
                piece.tool_calls.append(arguments_delta(index, arguments[len(call.arguments):]))
                call.arguments = arguments
            if scan.end is None:
                break
            call.complete = True
            self._call_pos = scan.end
        return piece


def read_forced(parser: ToolCallParser, max_calls: int, text: str) -> ReadMessage:
    """A whole forced answer: the calls as far as the text has them, and no content."""
    stream = ForcedCallStream(parser, max_calls)
    stream.feed(text)
    stream.finish()
    return ReadMessage(None, [call.as_tool_call() for call in stream.calls])
