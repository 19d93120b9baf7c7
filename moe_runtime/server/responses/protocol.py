"""The Responses API's request body (pydantic), as the official client and the OpenAI Agents SDK send it.

Unknown fields are ignored and named once in the log, as on the other routes (`server.protocol.RequestModel`):
the SDKs send `include`, `prompt_cache_key`, `service_tier` and others that change nothing here. Fields this
server cannot honour are refused by name (`unsupported_settings`): hosted tools (web search, file search,
...), `background` without `store`, image and file inputs.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.protocol import (FUNCTION_NAME_PATTERN, MAX_TOOLS, RequestModel, bounded,
                                         schema_with_bounded_depth)

MAX_INPUT_ITEMS = 4096        # items of one request's `input` (a long agent history is a few hundred)
MAX_METADATA_PAIRS = 16       # OpenAI's limit: 16 pairs, keys of 64 and values of 512 characters


class FunctionTool(RequestModel):
    """A function tool in the Responses API's flat shape (`name` beside `type`, not under `function`)."""

    type: str
    name: str | None = Field(default=None, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def schema_depth_is_bounded(cls, parameters: dict | None) -> dict | None:
        return schema_with_bounded_depth(parameters)


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None   # a hint to OpenAI's own models: accepted, no effect


class ReasoningOptions(RequestModel):
    effort: str | None = None      # none, minimal, low, medium, high, xhigh
    summary: str | None = None     # a summary of the reasoning: the reasoning itself is returned instead
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict] = Field(max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict | None = None      # none | auto | required | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = bounded("max_tokens", lo=1)
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(default=None, max_length=128)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # extensions, as on chat (vLLM's names)
    top_k: int | None = bounded("top_k")
    seed: int | None = bounded("seed")
    min_p: float | None = bounded("min_p")
    repetition_penalty: float | None = bounded("repetition_penalty")
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    chat_template_kwargs: dict | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=SamplingParams.MAX_CACHE_SALT_CHARS)

    @field_validator("metadata")
    @classmethod
    def metadata_is_bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return metadata
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs (got {len(metadata)})")
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
        return metadata
