"""/v1/chat/completions: chunks and the final response built from a `Generation`'s events.

With a `tool_calls` reader (the request offered tools), each choice's text goes through its own
`ToolCallStream`: content and tool-call deltas while streaming, content and `tool_calls` in a whole
response; a choice that called tools and ended by itself finishes with "tool_calls".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.completions import api_finish_reason, usage_of
from server.generation import ChoiceEvent, Generation
from server.logprobs import TokenNamer, chat_logprobs
from server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                             ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, DeltaMessage)
from server.tool_calls.plan import ToolCallReader
from server.tool_calls.stream import StreamPiece, ToolCallStream


def chat_finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's finish reason of a choice; one that called tools and stopped by itself says "tool_calls"."""
    reason = api_finish_reason(reason)
    return "tool_calls" if reason == "stop" and called_tools else reason


@dataclass
class ChatFormatter:
    generation: Generation
    model_name: str
    namer: TokenNamer
    want_logprobs: bool
    include_usage: bool = False
    continuous_usage: bool = False            # usage so far in every chunk (vLLM's continuous_usage_stats)
    tool_calls: ToolCallReader | None = None
    _texts: dict[int, str] = field(default_factory=dict)
    _logprobs: dict[int, list[ChatTokenLogprob]] = field(default_factory=dict)
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def _chunk(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        if usage is None and self.continuous_usage:
            usage = usage_of(self.generation)
        return ChatCompletionChunk(id=self.generation.request_id, model=self.model_name, choices=choices, usage=usage)

    # streaming
    def opening(self) -> list[ChatCompletionChunk]:
        """OpenAI opens each choice with the assistant role and empty content."""
        return [self._chunk([ChatChunkChoice(index=spec.index, delta=DeltaMessage(role="assistant", content=""))])
                for spec in self.generation.choices]

    def chunks(self, event: ChoiceEvent) -> list[ChatCompletionChunk]:
        delta = event.delta
        piece = self._read_tool_calls(event) if self.tool_calls is not None else StreamPiece(delta.text)
        if not (piece.content or piece.tool_calls or delta.finish_reason or (self.want_logprobs and delta.token_ids)):
            return []
        logprobs = chat_logprobs(delta.logprobs, self.namer) if self.want_logprobs else None
        called = event.index in self._tool_streams and self._tool_streams[event.index].called
        choice = ChatChunkChoice(index=event.index,
                                 delta=DeltaMessage(content=piece.content or None, tool_calls=piece.tool_calls or None),
                                 logprobs=logprobs, finish_reason=chat_finish_reason(delta.finish_reason, called))
        return [self._chunk([choice])]

    def _read_tool_calls(self, event: ChoiceEvent) -> StreamPiece:
        stream = self._tool_streams.get(event.index)
        if stream is None:
            stream = self._tool_streams[event.index] = self.tool_calls.stream()
        piece = stream.feed(event.delta.text)
        if event.delta.finish_reason is not None:
            piece.extend(stream.finish())
        return piece

    def closing(self) -> list[ChatCompletionChunk]:
        return [self._chunk([], usage_of(self.generation))] if self.include_usage else []

    # whole response
    def add(self, event: ChoiceEvent) -> None:
        self._texts[event.index] = self._texts.get(event.index, "") + event.delta.text
        if self.want_logprobs:
            self._logprobs.setdefault(event.index, []).extend(chat_logprobs(event.delta.logprobs, self.namer).content)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for spec in self.generation.choices:
            tracker = self.generation.trackers[spec.index]
            logprobs = ChatLogprobs(content=self._logprobs.get(spec.index, [])) if self.want_logprobs else None
            text = self._texts.get(spec.index, "")
            if self.tool_calls is None:
                message = AssistantMessage(content=text)
            else:
                read = self.tool_calls.read(text)
                message = AssistantMessage(content=read.content, tool_calls=read.tool_calls or None)
            choices.append(ChatChoice(index=spec.index, message=message, logprobs=logprobs,
                                      finish_reason=chat_finish_reason(tracker.finish_reason, bool(message.tool_calls))))
        return ChatCompletionResponse(id=self.generation.request_id, model=self.model_name, choices=choices,
                                      usage=usage_of(self.generation))
