"""Reading gpt-oss's answer (harmony channels) as it grows: reasoning, content and OpenAI tool calls.

The prompt ends with `<|start|>assistant`, so the answer begins with its first message's header. Each
message's body goes where its channel and recipient say:

- `analysis` (the chain of thought) -> reasoning;
- `final` -> content;
- `commentary` addressed `to=functions.NAME` -> a tool call NAME whose arguments are the body, held until
  the body ends and sent whole if it passes the request's check (`server.tool_calls.call_check`: an offered
  name, arguments valid for its schema), else the body is content (the message's markers delimit it, so the
  messages after it read as usual); `commentary` to no one (a preamble the model shows the user before
  calling tools) -> content;
- anything else addressed to a recipient outside `functions` (gpt-oss's built-in browser and python
  tools, which this server does not run) -> reasoning, so nothing the model wrote is lost.

The text carries the special tokens (decoded with them: `server.harmony_output`). A tail that may be the
start of a marker is held back, so markers cut across deltas are found. An answer with no harmony
header at all (structured output forced it into plain JSON) is content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from moe_runtime.front.output_processor import held_back_suffix
from moe_runtime.server.harmony_tokens import BODY_ENDS, CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE, START
from moe_runtime.server.protocol import ToolCall
from moe_runtime.server.tool_calls.call_check import ANY_OBJECT_ARGUMENTS, CallCheck
from moe_runtime.server.tool_calls.parser import openai_call_id
from moe_runtime.server.tool_calls.stream_piece import NO_ARGUMENTS, SentCall, StreamPiece, whole_call

RECIPIENT = re.compile(r"to=([^\s<]+)")
HEADER_MARKERS = [MESSAGE, START, CHANNEL, CONSTRAIN]


@dataclass(frozen=True)
class Header:
    role: str
    channel: str | None
    recipient: str | None

    @property
    def target(self) -> str:
        """"reasoning", "content" or "call": where the message's body goes."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith(FUNCTIONS) else "reasoning"
        return "reasoning" if self.channel == "analysis" else "content"


def parse_header(header: str) -> Header:
    """`assistant<|channel|>commentary to=functions.f <|constrain|>json` and its variants (the recipient may
    stand with the role or with the channel; the first message's role was written by the prompt)."""
    found = RECIPIENT.search(header)
    recipient = found.group(1) if found else None
    role_part, _, channel_part = header.partition(CHANNEL)
    role = RECIPIENT.sub("", role_part).strip() or "assistant"
    channel = channel_part.split(CONSTRAIN)[0]
    channel = RECIPIENT.sub("", channel).split()
    return Header(role, channel[0] if channel else None, recipient)


@dataclass
class HarmonyStream:
    new_call_id: Callable[[], str] = openai_call_id
    check: CallCheck = ANY_OBJECT_ARGUMENTS   # which calls may be sent (the request's `OfferedTools`)
    calls: list[SentCall] = field(default_factory=list)
    _pending: str = ""
    _state: str = "header"          # "header" (until <|message|>), "body", "between" (until <|start|>)
    _target: str = "content"
    _seen_marker: bool = False      # any harmony marker so far (else, at the end, the text is plain content)
    _call_name: str | None = None   # the call whose body is being read (held until the body ends)
    _call_body: str = ""

    def feed(self, text: str) -> StreamPiece:
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> StreamPiece:
        piece = self._advance(final=True)
        self._close_body(piece)   # a body cut short (max_tokens, or a stop token the engine kept out of the text)
        return piece

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def tool_calls(self) -> list[ToolCall]:
        return [call.as_tool_call() for call in self.calls]

    def _advance(self, final: bool) -> StreamPiece:
        piece = StreamPiece()
        while True:
            if self._state == "header" and not self._read_header(piece, final):
                return piece
            if self._state == "body" and not self._read_body(piece, final):
                return piece
            if self._state == "between" and not self._skip_to_start(final):
                return piece

    def _read_header(self, piece: StreamPiece, final: bool) -> bool:
        end = self._pending.find(MESSAGE)
        if end < 0:
            if final:
                if not self._seen_marker and START not in self._pending and CHANNEL not in self._pending:
                    piece.content += self._pending   # plain text: no harmony at all
                self._pending = ""
            return False
        header, self._pending = self._pending[:end], self._pending[end + len(MESSAGE):]
        self._seen_marker = True
        self._open_body(parse_header(header), piece)
        return True

    def _open_body(self, header: Header, piece: StreamPiece) -> None:
        self._state, self._target = "body", header.target
        if self._target == "call":
            self._call_name, self._call_body = header.recipient[len(FUNCTIONS):], ""

    def _read_body(self, piece: StreamPiece, final: bool) -> bool:
        found = [(index, marker) for marker in BODY_ENDS if (index := self._pending.find(marker)) >= 0]
        if not found:
            keep = 0 if final else held_back_suffix(self._pending, list(BODY_ENDS))
            cut = len(self._pending) - keep
            self._send(piece, self._pending[:cut])
            self._pending = self._pending[cut:]
            return False
        index, marker = min(found)
        self._send(piece, self._pending[:index])
        self._close_body(piece)
        self._pending = self._pending[index + (0 if marker == START else len(marker)):]
        self._state = "between"
        return True

    def _send(self, piece: StreamPiece, text: str) -> None:
        if not text:
            return
        if self._target == "reasoning":
            piece.reasoning += text
        elif self._target == "content":
            piece.content += text
        else:
            self._call_body += text

    def _close_body(self, piece: StreamPiece) -> None:
        """The end of a call's body: the call is sent if it passes the check, else its body is content. A call
        with no arguments gets `{}` (OpenAI's clients expect an object)."""
        if self._call_name is None:
            return
        name, body, self._call_name = self._call_name, self._call_body, None
        arguments = body if body.strip() else NO_ARGUMENTS
        if not self.check.accepts(name, arguments):
            piece.content += body
            return
        self.calls.append(SentCall(self.new_call_id(), name, arguments, complete=True))
        piece.tool_calls += whole_call(len(self.calls) - 1, self.calls[-1])

    def _skip_to_start(self, final: bool) -> bool:
        start = self._pending.find(START)
        if start < 0:
            keep = 0 if final else held_back_suffix(self._pending, [START])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._pending = self._pending[start + len(START):]
        self._state = "header"
        return True
