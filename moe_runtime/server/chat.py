"""/v1/chat/completions: chunks and the final response built from a `Generation`'s events.

Each choice has its own reader (`server.chat_reading`): with tools offered, content and tool-call deltas
while streaming, content and `tool_calls` in a whole response; with a reasoning parser (or harmony,
gpt-oss's channels) the reasoning goes to `reasoning_content` (and vLLM's `reasoning`). A choice that
called tools and ended by itself finishes with "tool_calls".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.completions import api_finish_reason, usage_of
from moe_runtime.server.errors import APIError
from moe_runtime.server.generation import ChoiceEvent, Generation
from moe_runtime.server.logprobs import TokenNamer, chat_logprobs
from moe_runtime.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                         ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, DeltaMessage)
from moe_runtime.server.chat_reading import ChatReading, ChoiceReader
from moe_runtime.server.routed_experts import RoutedExpertsJSON


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
    reading: ChatReading = ChatReading()       # tool calls, reasoning split or harmony channels (`chat_reading`)
    _logprobs: dict[int, list[ChatTokenLogprob]] = field(default_factory=dict)
    _readers: dict[int, ChoiceReader] = field(default_factory=dict)

    def _reader(self, index: int) -> ChoiceReader:
        reader = self._readers.get(index)
        if reader is None:
            reader = self._readers[index] = self.reading.choice()
        return reader

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
        reader = self._reader(event.index)
        piece = reader.feed(delta)
        if delta.finish_reason is not None:
            piece.extend(reader.finish())
        if not (piece.content or piece.reasoning or piece.tool_calls or delta.finish_reason
                or (self.want_logprobs and delta.token_ids)):
            return []
        logprobs = chat_logprobs(delta.logprobs, self.namer) if self.want_logprobs else None
        reasoning = piece.reasoning or None
        message = DeltaMessage(content=piece.content or None, tool_calls=piece.tool_calls or None,
                               reasoning_content=reasoning, reasoning=reasoning)
        choice = ChatChunkChoice(index=event.index, delta=message, logprobs=logprobs,
                                 finish_reason=chat_finish_reason(delta.finish_reason, reader.called),
                                 routed_experts=RoutedExpertsJSON.of(delta.routed_experts))
        return [self._chunk([choice])]

    def closing(self) -> list[ChatCompletionChunk]:
        return [self._chunk([], usage_of(self.generation))] if self.include_usage else []

    def failure(self, error: APIError) -> list[dict]:
        return [error.body()]

    def error_body(self, error: APIError) -> dict:
        return error.body()

    # whole response
    def add(self, event: ChoiceEvent) -> None:
        self._reader(event.index).add(event.delta)
        if self.want_logprobs:
            self._logprobs.setdefault(event.index, []).extend(chat_logprobs(event.delta.logprobs, self.namer).content)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for spec in self.generation.choices:
            tracker = self.generation.trackers[spec.index]
            logprobs = ChatLogprobs(content=self._logprobs.get(spec.index, [])) if self.want_logprobs else None
            message = self._reader(spec.index).message()
            choices.append(ChatChoice(index=spec.index, message=message, logprobs=logprobs,
                                      finish_reason=chat_finish_reason(tracker.finish_reason, bool(message.tool_calls)),
                                      routed_experts=RoutedExpertsJSON.of(tracker.routed_experts)))
        return ChatCompletionResponse(id=self.generation.request_id, model=self.model_name, choices=choices,
                                      usage=usage_of(self.generation))
