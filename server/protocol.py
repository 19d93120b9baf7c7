"""Request and response bodies of the OpenAI API subset this server speaks (pydantic).

Unknown request fields, at any depth, are ignored, as vLLM's server ignores them: clients written
for other servers send fields this one has no use for. The app logs each such name once
(`server.unknown_fields`). Fields this server knows but cannot honour are accepted only at their
no-op value and are a 400 naming them otherwise (see `unsupported_settings`): frequency_penalty and
presence_penalty at 0, logit_bias empty, repetition_penalty at 1.0, min_p at 0.0, and so on.
Extensions beyond OpenAI (as vLLM/SGLang offer them): top_k, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty and min_p (the last two not implemented yet: neutral values only).

The bounds of the sampling fields are `SamplingParams.validate`'s (the engine's); the few repeated
here take its constants, so that the schema shows them and a violation is a 400 naming the field.
"""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from moe_runtime.sampling_params import SamplingParams

TokenIds = list[int]


class RequestModel(BaseModel):
    """Keeps unknown fields in `model_extra`, so that the app can name them in its warning."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """What completions and chat share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=SamplingParams.SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # extensions
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)   # not implemented: 1.0 only
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)        # not implemented: 0.0 only

    def unsupported_settings(self) -> dict[str, object]:
        """Fields set to something this server cannot do: name -> value."""
        found = {}
        if self.frequency_penalty:
            found["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            found["presence_penalty"] = self.presence_penalty
        if self.logit_bias:
            found["logit_bias"] = self.logit_bias
        if self.repetition_penalty not in (None, 1.0):
            found["repetition_penalty"] = self.repetition_penalty
        if self.min_p:
            found["min_p"] = self.min_p
        return found


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def unsupported_settings(self) -> dict[str, object]:
        found = super().unsupported_settings()
        if self.echo:
            found["echo"] = True
        if self.suffix:
            found["suffix"] = self.suffix
        if self.best_of is not None and self.best_of != self.n:
            found["best_of"] = self.best_of
        return found


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One message of the conversation; replayed history may carry an assistant's `tool_calls` and the
    `tool_call_id` a tool message answers, which go on to the chat template (`template_message`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(RequestModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported_settings(self) -> dict[str, object]:
        found = super().unsupported_settings()
        if self.response_format is not None and self.response_format.type != "text":
            found["response_format"] = self.response_format.type
        if self.tools:
            found["tools"] = f"{len(self.tools)} tools"
        if self.tool_choice not in (None, "none"):
            found["tool_choice"] = self.tool_choice
        return found


# ---- responses -------------------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "moe-runtime"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
