"""A Responses request as the chat request it runs as (`as_chat_request`): the same rendering, tool plan,
structured output and sampling as /v1/chat/completions, so the two APIs answer alike.

- `instructions` lead as a system message (a previous response's instructions are not carried over, as
  OpenAI documents: each request gives its own);
- function tools go to the chat shape; `tool_choice` and `parallel_tool_calls` keep their meaning;
- `text.format` is `response_format`, except on a turn whose tool_choice forces calls: that answer has no text
  to shape, and the calls' own schema holds it (OpenAI takes both, and the Agents SDK sends both when an agent
  has an output type; chat completions refuse the pair, as one grammar holds an answer);
- `reasoning.effort` reaches the template (`server.reasoning.request_options`), and gpt-oss's harmony
  prompt as its reasoning effort (low, medium or high: `minimal` is low, `xhigh` high).
"""
from __future__ import annotations

import dataclasses
import re

from moe_runtime.server.errors import APIError, bad_request
from moe_runtime.server.protocol import (ChatCompletionRequest, ChatMessage, FunctionDefinition, JsonSchemaFormat,
                                         ResponseFormat, ToolDefinition)
from moe_runtime.server.reasoning.request_options import thinking_variables
from moe_runtime.server.responses.protocol import FunctionTool, ResponsesRequest

CHAT_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format"}   # a chat request's field -> this API's
HARMONY_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def as_chat_request(request: ResponsesRequest, messages: list[ChatMessage], harmony: bool) -> ChatCompletionRequest:
    """`messages`: the whole conversation (a previous response's, then this request's input)."""
    if request.instructions:
        messages = [ChatMessage(role="system", content=request.instructions), *messages]
    if not messages:
        raise bad_request("input is empty: give a message", "input")
    effort = request.reasoning.effort if request.reasoning is not None else None
    tool_choice = chat_tool_choice(request.tool_choice)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    template_kwargs = {**thinking_variables(None, effort), **(request.chat_template_kwargs or {})}
    fields = dict(
        model=request.model, messages=messages, max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, seed=request.seed,
        min_p=request.min_p, repetition_penalty=request.repetition_penalty, stop=request.stop,
        ignore_eos=request.ignore_eos,
        tools=chat_tools(request.tools), tool_choice=tool_choice, parallel_tool_calls=request.parallel_tool_calls,
        response_format=None if forced and request.tools else response_format(request),
        chat_template_kwargs=template_kwargs or None, cache_salt=request.cache_salt, user=request.user)
    if harmony and effort is not None:
        if effort not in HARMONY_EFFORTS:
            raise bad_request(f"reasoning.effort {effort!r}: this model reasons at low, medium or high effort",
                              "reasoning.effort")
        fields["reasoning_effort"] = HARMONY_EFFORTS[effort]
    return ChatCompletionRequest(**fields)


def in_responses_terms(error: APIError) -> APIError:
    """A refusal of the chat request, naming this request's fields (`input`, not `messages`)."""
    message = re.sub(r"^messages\b", "input", error.message)
    for chat_name, name in CHAT_FIELD_NAMES.items():
        if chat_name != "messages":
            message = re.sub(rf"\b{chat_name}\b", name, message)
    return dataclasses.replace(error, message=message, param=CHAT_FIELD_NAMES.get(error.param, error.param))


def chat_tools(tools: list[FunctionTool] | None) -> list[ToolDefinition] | None:
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(f"tools[{index}] is a {tool.type!r} tool: this server runs function tools only "
                              "(hosted tools such as web_search are OpenAI's)", f"tools[{index}].type")
        if tool.name is None:
            raise bad_request(f"tools[{index}].name is missing", f"tools[{index}].name")
        converted.append(ToolDefinition(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    return converted


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a named function (got {choice!r})",
                              "tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("a named tool_choice is {'type': 'function', 'name': NAME} (hosted tools and "
                          "allowed_tools are not served)", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}   # chat's shape (validated there)


def response_format(request: ResponsesRequest) -> ResponseFormat | None:
    given = request.text.format if request.text is not None else None
    if given is None or given.type == "text":
        return None
    if given.type == "json_object":
        return ResponseFormat(type="json_object")
    if given.schema_ is None:
        raise bad_request("text.format json_schema needs its 'schema'", "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=given.name, description=given.description, schema=given.schema_, strict=given.strict))
