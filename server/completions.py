"""/v1/completions: chunks and the final response built from a `Generation`'s events."""
from __future__ import annotations

from dataclasses import dataclass, field

from server.generation import ChoiceEvent, Generation
from server.logprobs import TokenNamer, completion_logprobs
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo


def api_finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted choice reports none."""
    return reason if reason in ("stop", "length") else None


def usage_of(generation: Generation) -> UsageInfo:
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class CompletionFormatter:
    generation: Generation
    model_name: str
    namer: TokenNamer
    want_logprobs: bool
    include_usage: bool = False
    _texts: dict[int, str] = field(default_factory=dict)
    _logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict)

    def _logprobs_of(self, event: ChoiceEvent, offset: int) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        return completion_logprobs(event.delta.logprobs, self.namer, offset)

    # streaming
    def opening(self) -> list:
        return []

    def chunks(self, event: ChoiceEvent) -> list[CompletionResponse]:
        delta = event.delta
        if not (delta.text or delta.finish_reason or (self.want_logprobs and delta.token_ids)):
            return []
        offset = len(self._texts.get(event.index, ""))
        self._texts[event.index] = self._texts.get(event.index, "") + delta.text
        choice = CompletionChoice(index=event.index, text=delta.text, logprobs=self._logprobs_of(event, offset),
                                  finish_reason=api_finish_reason(delta.finish_reason))
        return [CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=[choice])]

    def closing(self) -> list[CompletionResponse]:
        if not self.include_usage:
            return []
        return [CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=[],
                                   usage=usage_of(self.generation))]

    # whole response
    def add(self, event: ChoiceEvent) -> None:
        offset = len(self._texts.get(event.index, ""))
        self._texts[event.index] = self._texts.get(event.index, "") + event.delta.text
        if self.want_logprobs:
            part = completion_logprobs(event.delta.logprobs, self.namer, offset)
            whole = self._logprobs.setdefault(event.index, CompletionLogprobs())
            whole.tokens += part.tokens
            whole.token_logprobs += part.token_logprobs
            whole.top_logprobs += part.top_logprobs
            whole.text_offset += part.text_offset

    def response(self) -> CompletionResponse:
        choices = []
        for spec in self.generation.choices:
            tracker = self.generation.trackers[spec.index]
            choices.append(CompletionChoice(
                index=spec.index,
                text=self._texts.get(spec.index, ""),
                logprobs=self._logprobs.get(spec.index, CompletionLogprobs()) if self.want_logprobs else None,
                finish_reason=api_finish_reason(tracker.finish_reason),
            ))
        return CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=choices,
                                  usage=usage_of(self.generation))
