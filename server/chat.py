"""/v1/chat/completions: chunks and the final response built from a `Generation`'s events."""
from __future__ import annotations

from dataclasses import dataclass, field

from server.completions import api_finish_reason, usage_of
from server.generation import ChoiceEvent, Generation
from server.logprobs import TokenNamer, chat_logprobs
from server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                             ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, DeltaMessage)


@dataclass
class ChatFormatter:
    generation: Generation
    model_name: str
    namer: TokenNamer
    want_logprobs: bool
    include_usage: bool = False
    _texts: dict[int, str] = field(default_factory=dict)
    _logprobs: dict[int, list[ChatTokenLogprob]] = field(default_factory=dict)

    def _chunk(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.generation.request_id, model=self.model_name, choices=choices, usage=usage)

    # streaming
    def opening(self) -> list[ChatCompletionChunk]:
        """OpenAI opens each choice with the assistant role and empty content."""
        return [self._chunk([ChatChunkChoice(index=spec.index, delta=DeltaMessage(role="assistant", content=""))])
                for spec in self.generation.choices]

    def chunks(self, event: ChoiceEvent) -> list[ChatCompletionChunk]:
        delta = event.delta
        if not (delta.text or delta.finish_reason or (self.want_logprobs and delta.token_ids)):
            return []
        logprobs = chat_logprobs(delta.logprobs, self.namer) if self.want_logprobs else None
        choice = ChatChunkChoice(index=event.index, delta=DeltaMessage(content=delta.text or None),
                                 logprobs=logprobs, finish_reason=api_finish_reason(delta.finish_reason))
        return [self._chunk([choice])]

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
            choices.append(ChatChoice(index=spec.index, message=AssistantMessage(content=self._texts.get(spec.index, "")),
                                      logprobs=logprobs, finish_reason=api_finish_reason(tracker.finish_reason)))
        return ChatCompletionResponse(id=self.generation.request_id, model=self.model_name, choices=choices,
                                      usage=usage_of(self.generation))
