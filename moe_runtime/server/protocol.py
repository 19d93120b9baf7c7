"""Request and response bodies of the OpenAI API subset this server speaks (pydantic).

Unknown request fields, at any depth, are ignored, as vLLM's server ignores them: clients written
for other servers send fields this one has no use for. The app logs each such name once
(`server.unknown_fields`). Fields this server knows but cannot honour are accepted only at their
no-op value and are a 400 naming them otherwise (see `unsupported_settings`).
Extensions beyond OpenAI (as vLLM/SGLang offer them): top_k, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty, min_p, on completions prompt_logprobs, and structured output in vLLM's shapes
(guided_json, guided_regex, guided_grammar, guided_choice, structured_outputs) beside OpenAI's
response_format, which completions accept too (`server.structured_output_request` reads them all).

The bounds of the sampling fields are the engine's table, `moe_runtime.sampling.bounds.BOUNDS`: each
number field takes its constraints from it (`bounded`: the schema shows them, a violation is a 400
naming the field), and the list and mapping fields (stop, stop_token_ids, logit_bias) are checked by
the table's own `refusal`, which the engine's admission check applies too. The HTTP layer and the
engine take and refuse the same values (tests/test_request_bounds.py checks every edge of the table).
"""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from moe_runtime.sampling.bounds import BOUND, TOKEN_ID_DIGITS, refusal
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.routed_experts import RoutedExpertsJSON
from moe_runtime.sampling.structured_output.schema_bounds import MAX_SCHEMA_DEPTH, object_nesting_depth

TokenIds = list[int]


def bounded(name: str, default: object = None, **override) -> object:
    """A `Field` with the bounds table's constraints of `name` (`override`: an endpoint's stricter lo/hi)."""
    return Field(default=default, **BOUND[name].schema(**override))


def digit_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as JSON object keys (strings); the engine's are integers.

    A key longer than any token id is refused before int() sees it: int() refuses more than 4,300 digits
    with a message about Python's settings, and takes a few thousand in quadratic time."""
    converted = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit()):   # int() alone would also take " 5", "+5" and "5_0"
            raise ValueError(f"keys must be token ids (got {key[:20]!r})")
        if len(key) > TOKEN_ID_DIGITS:
            raise ValueError(f"keys must be token ids ({BOUND['logit_bias.key'].describe()}): got a key of "
                             f"{len(key)} digits")
        converted[int(key)] = bias
    return converted


class RequestModel(BaseModel):
    """Keeps unknown fields in `model_extra`, so that the app can name them in its warning."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`. `strict` is accepted and has no effect: the output always
    follows the schema."""

    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")   # "schema" shadows a BaseModel attribute
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs`: one of json (a schema), json_object, regex, grammar (EBNF), choice."""

    json_: dict | bool | str | None = Field(default=None, alias="json")   # "json" shadows a BaseModel attribute
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    disable_any_whitespace: bool | None = None   # JSON without whitespace between elements (default: the server's)


class SamplingFields(RequestModel):
    """What completions and chat share."""

    model: str | None = None
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    top_k: int | None = bounded("top_k")
    seed: int | None = bounded("seed")
    stop: str | list[str] | None = None
    n: int = bounded("n", 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = bounded("frequency_penalty")
    presence_penalty: float | None = bounded("presence_penalty")
    logit_bias: dict[str, float] | None = None
    # extensions
    min_tokens: int = bounded("min_tokens", 0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = bounded("repetition_penalty")
    min_p: float | None = bounded("min_p")
    # structured output: OpenAI's response_format, or one of vLLM's (at most one of them all)
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputsField | None = None
    # prefill/decode disaggregation (vLLM's name): {"do_remote_decode": true} asks a prefill instance to park the
    # prompt's KV and answer with a handle; a decode instance given that handle continues the request
    kv_transfer_params: dict | None = None
    # vLLM's: the prompt's KV blocks are shared only with requests of the same salt (and, with several API
    # keys, of the same key: `server.tenant_salt`), so no one learns another's prompt from a cache hit's speed
    cache_salt: str | None = Field(None, min_length=1, max_length=SamplingParams.MAX_CACHE_SALT_CHARS)
    # routing replay: each choice's logical expert ids per position and MoE layer (its
    # `routed_experts`), and the ids to force for the first positions (server/routed_experts.py)
    return_routed_experts: bool = False
    forced_routed_experts: RoutedExpertsJSON | None = None

    @field_validator("stop", "stop_token_ids", "logit_bias")
    @classmethod
    def _inside_the_bounds(cls, value: object, info) -> object:
        """The bounds table's check of a list or mapping field (the engine's own `refusal`)."""
        if value is None:
            return value
        why = refusal(info.field_name, digit_keys(value) if info.field_name == "logit_bias" else value)
        if why is not None:
            raise ValueError(why)
        return value

    def unsupported_settings(self) -> dict[str, object]:
        """Fields set to something this server cannot do: name -> value."""
        return {}


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = bounded("max_tokens", 16)   # 0: only with echo or prompt_logprobs (score the prompt)
    logprobs: int | None = bounded("logprobs")
    echo: bool = False                                   # the prompt leads the text (and, with logprobs, the logprobs)
    prompt_logprobs: int | None = bounded("prompt_logprobs")   # vLLM's extension
    suffix: str | None = None
    best_of: int | None = bounded("n")                   # accepted only equal to n

    def unsupported_settings(self) -> dict[str, object]:
        found = super().unsupported_settings()
        if self.suffix:
            found["suffix"] = self.suffix
        if self.best_of is not None and self.best_of != self.n:
            found["best_of"] = self.best_of
        return found


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})   # OpenAI's, the Responses API's, Anthropic's


class ChatMessage(RequestModel):
    """One message of the conversation; replayed history may carry an assistant's `tool_calls` and the
    `tool_call_id` a tool message answers, which go on to the chat template (`template_message`). Content
    parts are text: an image part is refused by name (the served models are text models, a multimodal
    release's vision tower is not loaded: `moe_runtime.config.multimodal_wrappers`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None      # an assistant turn's reasoning, as this server returned it
    reasoning: str | None = None              # ... under vLLM's newer name

    @field_validator("content", mode="before")
    @classmethod
    def no_images(cls, content):
        if isinstance(content, list):
            for index, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    raise ValueError(f"part {index} is an image ({part['type']}): images are not served here, "
                                     "only text (the served model's vision tower, if it has one, is not loaded)")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_TOOLS = 128                               # OpenAI's limit on tools per request
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"   # OpenAI's letters, digits, _ and - (plus . and :), 1-64


def schema_with_bounded_depth(schema: dict | None) -> dict | None:
    """A tool's parameter schema, refused when nested deeper than structured output's bound: chat templates and
    the tool-call checks walk it recursively (every API's tools: chat's, the Responses and Messages APIs')."""
    depth = object_nesting_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema is nested {depth} levels deep (objects and arrays); at most "
                         f"{MAX_SCHEMA_DEPTH} are accepted")
    return schema


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None            # a JSON schema of the arguments object; absent: no arguments
    strict: bool | None = None                # accepted; required/named calls follow the schema in any case

    @field_validator("parameters")
    @classmethod
    def schema_depth_is_bounded(cls, parameters: dict | None) -> dict | None:
        return schema_with_bounded_depth(parameters)


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


TOOL_CHOICE_MODES = ("none", "auto", "required")


class NamedFunction(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = bounded("max_tokens", lo=1)   # a chat answer has at least one token
    max_completion_tokens: int | None = bounded("max_tokens", lo=1)
    logprobs: bool = False
    top_logprobs: int | None = bounded("logprobs")       # the engine's logprobs
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | NamedToolChoice | None = None    # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None             # vLLM's: extra variables for the chat template
    continue_final_message: bool = False                 # vLLM's: the answer continues the last (assistant) message
    reasoning_effort: str | None = None                  # gpt-oss (harmony): low, medium, high
    echo: bool = False                                   # vLLM's extension: not implemented (a 400)
    prompt_logprobs: int | None = None                   # vLLM's extension: /v1/completions only (a 400 here)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, value: object) -> object:
        """One error naming `tool_choice` for any wrong value (a union would name its branches instead)."""
        if value is None or value in TOOL_CHOICE_MODES:
            return value
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError as exc:
                raise ValueError(f"a named tool choice is {{'type': 'function', 'function': {{'name': NAME}}}} "
                                 f"({exc.errors()[0]['msg']})") from None
        raise ValueError(f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function")

    def unsupported_settings(self) -> dict[str, object]:
        found = super().unsupported_settings()
        if self.echo:
            found["echo"] = True
        if self.prompt_logprobs is not None:
            found["prompt_logprobs"] = self.prompt_logprobs
        return found


# ---- responses -------------------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)        # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a position in vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None    # vLLM's extension, when asked for
    routed_experts: RoutedExpertsJSON | None = None   # return_routed_experts: on the choice's final part


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


class FunctionCall(BaseModel):
    name: str
    arguments: str                            # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitsNoReasoning(BaseModel):
    """Serialized without the reasoning fields when there is no reasoning, so a server without a reasoning
    parser answers exactly as before. The reasoning goes out under both names: `reasoning_content`
    (DeepSeek's, SGLang's and most clients') and `reasoning` (vLLM's since late 2025)."""

    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_reasoning(self, serialize):
        return {key: value for key, value in serialize(self).items()
                if value is not None or key not in ("reasoning_content", "reasoning")}


class AssistantMessage(OmitsNoReasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    routed_experts: RoutedExpertsJSON | None = None   # return_routed_experts


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class OmitsUnset(BaseModel):
    """Serialized without the fields left None, as OpenAI omits them: a streamed call's later deltas carry no
    `id`, `type` or `name` (openai-python's stream helper merges deltas, and a null would overwrite them)."""

    @model_serializer(mode="wrap")
    def _without_none(self, serialize):
        return {key: value for key, value in serialize(self).items() if value is not None}


class DeltaFunctionCall(OmitsUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitsUnset):
    """A call's first delta has its id, type and function name; later ones carry argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(OmitsNoReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    routed_experts: RoutedExpertsJSON | None = None   # return_routed_experts: in the choice's final chunk


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
