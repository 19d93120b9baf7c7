"""How each choice of a chat answer is read (`ChatReading.choice`): reasoning, content and tool calls.

Three readings, one interface (`ChoiceReader`): streamed (`feed` each delta, `finish` at the end) or whole
(`add` each delta, then `message`).

- plain text, no reasoning parser: content, and the tool calls of a request that offered tools (as before
  reasoning parsers existed: a server without `--reasoning-parser` answers exactly as it did);
- a `<think>` reasoning parser (`server.reasoning`): the text split into reasoning and content first, then
  the content (only) read for tool calls, so a call the model drafts in its reasoning is never called;
- harmony (gpt-oss): channels carry all three (`server.harmony_output`).

A forced answer (`tool_choice` required or named) is the structured-output JSON of its calls and nothing
else: it is read as calls without a reasoning split (the grammar holds from the first token, so there is no
reasoning to split off).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from moe_runtime.server.deltas import ChoiceDelta
from moe_runtime.server.harmony_output import HarmonyFormat
from moe_runtime.server.protocol import AssistantMessage
from moe_runtime.server.reasoning.parser import ReasoningParser, ReasoningStream, split_whole
from moe_runtime.server.reasoning.prompt_state import PromptReasoning
from moe_runtime.server.tool_calls.plan import ToolCallReader
from moe_runtime.server.tool_calls.stream import StreamPiece, ToolCallStream


class ChoiceReader(Protocol):
    @property
    def called(self) -> bool:
        """True once a tool call has been announced (the choice then finishes with "tool_calls")."""
        ...

    def feed(self, delta: ChoiceDelta) -> StreamPiece: ...

    def finish(self) -> StreamPiece: ...

    def add(self, delta: ChoiceDelta) -> None: ...

    def message(self) -> AssistantMessage: ...


@dataclass
class TextChoiceReader:
    tool_calls: ToolCallReader | None = None
    reasoning: ReasoningParser | None = None
    prompt: PromptReasoning = PromptReasoning.UNSAID
    _text: str = ""
    _reasoning_stream: ReasoningStream | None = None
    _tool_stream: ToolCallStream | None = None

    def __post_init__(self) -> None:
        self._reasoning_stream = self.reasoning.stream(self.prompt) if self.reasoning is not None else None
        self._tool_stream = self.tool_calls.stream() if self.tool_calls is not None else None

    @property
    def called(self) -> bool:
        return self._tool_stream is not None and self._tool_stream.called

    def feed(self, delta: ChoiceDelta) -> StreamPiece:
        return self._read(delta.text, final=False)

    def finish(self) -> StreamPiece:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> StreamPiece:
        piece = StreamPiece()
        content = text
        if self._reasoning_stream is not None:
            split = self._reasoning_stream.feed(text)
            if final:
                split.extend(self._reasoning_stream.finish())
            piece.reasoning, content = split.reasoning, split.content
        if self._tool_stream is None:
            piece.content = content
            return piece
        piece.extend(self._tool_stream.feed(content))
        if final:
            piece.extend(self._tool_stream.finish())
        return piece

    def add(self, delta: ChoiceDelta) -> None:
        self._text += delta.text

    def message(self) -> AssistantMessage:
        reasoning, content = None, self._text
        if self.reasoning is not None:
            split = split_whole(self.reasoning, self._text, self.prompt)
            reasoning, content = split.reasoning or None, split.content or None
        if self.tool_calls is None:
            return AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)
        read = self.tool_calls.read(content or "")
        return AssistantMessage(content=read.content, tool_calls=read.tool_calls or None,
                                reasoning_content=reasoning, reasoning=reasoning)


@dataclass(frozen=True)
class ChatReading:
    """The reading of one request's choices."""

    tool_calls: ToolCallReader | None = None     # the request offered tools (None: plain content)
    reasoning: ReasoningParser | None = None     # --reasoning-parser, a <think> family
    harmony: HarmonyFormat | None = None         # the model answers in harmony channels
    prompt: PromptReasoning = PromptReasoning.UNSAID   # where the prompt left the reasoning block

    def choice(self) -> ChoiceReader:
        forced = self.tool_calls is not None and self.tool_calls.forced
        if self.harmony is not None and not forced:   # harmony's calls pass the request's tool check too
            return self.harmony.reader(self.tool_calls.check) if self.tool_calls is not None else self.harmony.reader()
        return TextChoiceReader(self.tool_calls, None if forced else self.reasoning, self.prompt)
