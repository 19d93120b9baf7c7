"""The Messages API's request and response bodies, as Anthropic defines them (pydantic).

Requests: a message's content is a string or a list of blocks (text, tool_use, tool_result, thinking,
redacted_thinking); a string is read as one text block, so every message is a list of blocks from here on.
Blocks this server cannot take (images, documents, server tools' blocks) are a 400 naming the message's
content, as chat refuses an image part. Unknown fields, at any depth, are ignored (`RequestModel`: the app
warns once per name), e.g. `cache_control` on a block, `metadata`, `service_tier`.

Only client tools ({name, description, input_schema}) are served: a server tool (`web_search_20250305`,
`bash_20250124`, ...) runs on Anthropic's side, so it is a 400 naming it. The sampling fields take the bounds
of chat's (`moe_runtime.sampling.bounds`), so a request converts into a chat request that validates.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, field_validator

from moe_runtime.sampling.bounds import refusal
from moe_runtime.server.protocol import (FUNCTION_NAME_PATTERN, IMAGE_PART_TYPES, MAX_TOOLS, RequestModel,
                                         bounded, schema_with_bounded_depth)

THINKING_SIGNATURE = ""   # thinking blocks carry a signature; this server signs nothing (and verifies none)
SERVED_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
CLIENT_TOOL_TYPES = (None, "custom")   # a tool without a type, or "custom", is the client's; others are servers'


# ---- request ---------------------------------------------------------------------------------------------

class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(RequestModel):
    """A call the assistant made (replayed history)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


def as_text_blocks(content: object) -> object:
    """A string is one text block; None no block."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content


def refuse_unserved_blocks(content: object) -> object:
    """A 400 naming the block for an image (as chat refuses one) or any block type this server does not take."""
    if not isinstance(content, list):
        return content
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in IMAGE_PART_TYPES:
            raise ValueError(f"block {index} is an image ({kind}): images are not served here, only text (the "
                             "served model's vision tower, if it has one, is not loaded)")
        if isinstance(kind, str) and kind not in SERVED_BLOCK_TYPES:
            raise ValueError(f"block {index} is a {kind!r} block, which this server does not take (it takes "
                             f"{', '.join(SERVED_BLOCK_TYPES)})")
    return content


class ToolResultBlockParam(RequestModel):
    """What a tool returned, answering the call `tool_use_id`; its content is text (a string or text blocks)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlockParam] = Field(default_factory=list)
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, content: object) -> object:
        return refuse_unserved_blocks(as_text_blocks(content))


class ThinkingBlockParam(RequestModel):
    """The assistant's reasoning (replayed history); its signature is not checked (this server signs none)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(RequestModel):
    """Reasoning only Anthropic can read: dropped."""

    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlockParam = Annotated[Union[TextBlockParam, ToolUseBlockParam, ToolResultBlockParam, ThinkingBlockParam,
                                    RedactedThinkingBlockParam], Field(discriminator="type")]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: list[ContentBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: object) -> object:
        return refuse_unserved_blocks(as_text_blocks(content))


class ToolParam(RequestModel):
    """A client tool: the model calls it, the client runs it and answers with a tool_result."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict
    type: str | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema_depth_is_bounded(cls, schema: dict) -> dict:
        return schema_with_bounded_depth(schema)


class ToolChoiceParam(RequestModel):
    """auto: the model decides; any: it must call a tool; tool: it must call `name`; none: it calls none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME_PATTERN)
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(RequestModel):
    """enabled / disabled: the template is asked to think or not; adaptive: as the model likes. The budget is
    accepted and not enforced (a reasoning parser cannot stop the reasoning alone: max_tokens bounds it all)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class MessagesBody(RequestModel):
    """What a conversation is: /v1/messages/count_tokens takes this, /v1/messages adds the generation's settings."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, system: object) -> object:
        return as_text_blocks(system) if system is not None else None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, tools: object) -> object:
        """A server tool runs on Anthropic's side: refused by name before its missing input_schema is."""
        if isinstance(tools, list):
            for index, tool in enumerate(tools):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind not in CLIENT_TOOL_TYPES:
                    raise ValueError(f"tool {index} is a server tool ({kind!r}), which runs on Anthropic's side: this "
                                     "server serves client tools ({name, description, input_schema}) only")
        return tools


class MessagesRequest(MessagesBody):
    max_tokens: int = bounded("max_tokens", ..., lo=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    top_k: int | None = bounded("top_k")
    stream: bool = False
    metadata: dict | None = None   # accepted, unused (Anthropic's user_id for abuse tracking)

    @field_validator("stop_sequences")
    @classmethod
    def _inside_the_stop_bounds(cls, value: list[str] | None) -> list[str] | None:
        """Chat's `stop` bounds (the engine's own `refusal`), named as this field."""
        why = refusal("stop", value) if value is not None else None
        if why is not None:
            raise ValueError(why)
        return value


# ---- response --------------------------------------------------------------------------------------------

class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = THINKING_SIGNATURE


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


ContentBlock = Union[ThinkingBlock, TextBlock, ToolUseBlock]


class MessagesUsage(BaseModel):
    """Anthropic counts the prompt in three parts: `input_tokens` computed, `cache_read_input_tokens` found in
    the prefix cache, `cache_creation_input_tokens` written to a cache on request (never: caching is automatic)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None     # None only in the streamed message_start
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int
