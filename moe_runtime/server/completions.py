"""/v1/completions: chunks and the final response built from a `Generation`'s events."""
from __future__ import annotations

from dataclasses import dataclass, field

from moe_runtime.server.errors import APIError
from moe_runtime.server.generation import ChoiceEvent, ChoiceSpec, Generation
from moe_runtime.server.logprobs import TokenNamer, completion_logprobs, echoed_prompt_logprobs, vllm_prompt_logprobs
from moe_runtime.server.protocol import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo
from moe_runtime.server.routed_experts import RoutedExpertsJSON


def api_finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted choice reports none."""
    return reason if reason in ("stop", "length") else None


def usage_of(generation: Generation) -> UsageInfo:
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def append_logprobs(whole: CompletionLogprobs, part: CompletionLogprobs) -> None:
    whole.tokens += part.tokens
    whole.token_logprobs += part.token_logprobs
    whole.top_logprobs += part.top_logprobs
    whole.text_offset += part.text_offset


@dataclass
class CompletionFormatter:
    """With `echo`, each choice's first part leads with its prompt: the text (`ChoiceSpec.prompt_text`) and,
    with logprobs, the prompt tokens' logprobs (the first token's null). `prompt_logprobs` (vLLM's extension)
    adds the prompt's logprobs in vLLM's shape to each choice's first part."""

    generation: Generation
    model_name: str
    namer: TokenNamer
    want_logprobs: bool
    include_usage: bool = False
    continuous_usage: bool = False           # usage so far in every chunk (vLLM's continuous_usage_stats)
    echo: bool = False
    num_logprobs: int = 0                    # the request's `logprobs`: alternatives shown per echoed token
    prompt_logprobs: int | None = None       # the request's `prompt_logprobs`
    _texts: dict[int, str] = field(default_factory=dict)
    _logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict)
    _prompt_logprobs: dict[int, list] = field(default_factory=dict)
    _specs: dict[int, ChoiceSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._specs = {spec.index: spec for spec in self.generation.choices}

    def _part(self, event: ChoiceEvent) -> CompletionChoice:
        """What `event` adds to its choice (and records it): new text and logprobs, after the echoed prompt on
        the choice's first event."""
        delta = event.delta
        before = self._texts.get(event.index, "")
        prompt = self._specs[event.index]
        entries = None                                                                # [P], the first None
        if delta.first:
            entries = delta.prompt_logprobs or [None] * len(prompt.prompt_token_ids)
        echo = self.echo and delta.first
        echoed_text = prompt.prompt_text if echo else ""
        logprobs = None
        if self.want_logprobs:
            logprobs = CompletionLogprobs()
            if echo:
                append_logprobs(logprobs, echoed_prompt_logprobs(prompt.prompt_token_ids, entries, self.namer,
                                                                 self.num_logprobs, echoed_text))
            offset = len(before) + len(echoed_text)
            append_logprobs(logprobs, completion_logprobs(delta.logprobs, self.namer, offset))
        prompt_logprobs = None
        if self.prompt_logprobs is not None and delta.first:
            prompt_logprobs = vllm_prompt_logprobs(entries, self.namer, self.prompt_logprobs)
            self._prompt_logprobs[event.index] = prompt_logprobs
        text = echoed_text + delta.text
        self._texts[event.index] = before + text
        return CompletionChoice(index=event.index, text=text, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                finish_reason=api_finish_reason(delta.finish_reason),
                                routed_experts=RoutedExpertsJSON.of(delta.routed_experts))

    # streaming
    def opening(self) -> list:
        return []

    def chunks(self, event: ChoiceEvent) -> list[CompletionResponse]:
        delta = event.delta
        choice = self._part(event)
        if not (choice.text or delta.finish_reason or choice.prompt_logprobs is not None
                or (self.want_logprobs and choice.logprobs.tokens)):
            return []
        usage = usage_of(self.generation) if self.continuous_usage else None
        return [CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=[choice], usage=usage)]

    def closing(self) -> list[CompletionResponse]:
        if not self.include_usage:
            return []
        return [CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=[],
                                   usage=usage_of(self.generation))]

    # whole response
    def failure(self, error: APIError) -> list[dict]:
        return [error.body()]

    def error_body(self, error: APIError) -> dict:
        return error.body()

    def add(self, event: ChoiceEvent) -> None:
        part = self._part(event)
        if self.want_logprobs:
            append_logprobs(self._logprobs.setdefault(event.index, CompletionLogprobs()), part.logprobs)

    def response(self) -> CompletionResponse:
        choices = []
        for spec in self.generation.choices:
            tracker = self.generation.trackers[spec.index]
            choices.append(CompletionChoice(
                index=spec.index,
                text=self._texts.get(spec.index, ""),
                logprobs=self._logprobs.get(spec.index, CompletionLogprobs()) if self.want_logprobs else None,
                finish_reason=api_finish_reason(tracker.finish_reason),
                prompt_logprobs=self._prompt_logprobs.get(spec.index),
                routed_experts=RoutedExpertsJSON.of(tracker.routed_experts),
            ))
        return CompletionResponse(id=self.generation.request_id, model=self.model_name, choices=choices,
                                  usage=usage_of(self.generation))
