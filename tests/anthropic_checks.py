"""Anthropic's Messages API checked against a running server with the official `anthropic` client:
`check_messages_api(base_url, model, api_key)` runs a plain create, a stream (the SDK's helper and the raw event
order), forced tool calls (tool_choice any and a named tool, streamed and whole), a tool_result round trip,
thinking disabled, count_tokens and the key as `x-api-key`, and asserts the shapes. Any model will do (random
weights too): forced calls go through structured output, so their input always matches the tool's schema.

    from anthropic_checks import check_messages_api
    check_messages_api(server.base_url, "moe-runtime-demo", API_KEY)
"""
from __future__ import annotations

import json

import anthropic
import httpx2
import jsonschema

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Forecast for the user's city.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time now.", "input_schema": TIME}]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be like?"}]
BLOCK_TYPES = {"text", "thinking", "tool_use"}
TEXT_MAX_TOKENS = 24   # a plain answer's length in the checks (a random model may never stop by itself)
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
EVENT_TYPES = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
               "message_stop"}


def check_messages_api(base_url: str, model: str, api_key: str | None = None, max_tokens: int = 400,
                       timeout_s: float = 120.0) -> None:
    """`base_url`: the server's root (the SDK adds /v1/messages). `max_tokens` must leave room for a forced call
    (the demo model's take 40-250 tokens)."""
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout_s)
    ask = dict(model=model, max_tokens=max_tokens, messages=ASK)
    text_ask = {**ask, "max_tokens": min(max_tokens, TEXT_MAX_TOKENS)}   # text needs no room: cut is a shape too
    message = client.messages.create(**text_ask)
    check_message(message, model)
    check_stream(client, text_ask, model)
    called = check_forced_calls(client, ask, model)
    check_tool_result_round_trip(client, ask, model, called)
    check_thinking_disabled(client, text_ask, model)
    check_count_tokens(client, ask)
    if api_key is not None:
        check_x_api_key(base_url, ask, api_key, timeout_s)


def check_message(message, model: str) -> None:
    """A whole message's shape."""
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == model and message.stop_reason in STOP_REASONS
    assert all(block.type in BLOCK_TYPES for block in message.content)
    assert (message.stop_sequence is not None) == (message.stop_reason == "stop_sequence")
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0 and usage.output_tokens >= 1
    assert usage.cache_creation_input_tokens == 0
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_") and isinstance(block.input, dict)
        if block.type == "thinking":
            assert isinstance(block.signature, str)


def check_event_order(events: list[dict]) -> None:
    """message_start; blocks started, grown and stopped one at a time, indices 0, 1, ...; message_delta,
    message_stop. A thinking block's signature_delta comes just before it stops."""
    kinds = [event["type"] for event in events]
    assert set(kinds) <= EVENT_TYPES, kinds
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    open_block, next_index, last_delta = None, 0, None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_block is None and event["index"] == next_index
            open_block, next_index = event, next_index + 1
        elif event["type"] == "content_block_delta":
            assert open_block is not None and event["index"] == open_block["index"]
            last_delta = event["delta"]["type"]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_block["index"]
            kind = open_block["content_block"]["type"]
            assert (last_delta == "signature_delta") == (kind == "thinking")
            open_block, last_delta = None, None
    assert open_block is None
    assert events[-2]["delta"]["stop_reason"] in STOP_REASONS and events[-2]["usage"]["output_tokens"] >= 1


def check_stream(client: anthropic.Anthropic, ask: dict, model: str) -> None:
    raw = [event.model_dump() for event in client.messages.create(**ask, stream=True)]
    check_event_order(raw)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check_message(final, model)
    assert text == "".join(block.text for block in final.content if block.type == "text")


def check_calls(message, allowed: set[str]) -> list:
    """The message's tool_use blocks: at least one, each of an offered tool with an input valid for its schema."""
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use", message
    for call in calls:
        assert call.name in allowed
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls


def check_forced_calls(client: anthropic.Anthropic, ask: dict, model: str) -> list:
    """tool_choice a named tool and any, whole and streamed; returns the named call's message's calls."""
    named = client.messages.create(**ask, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    check_message(named, model)
    calls = check_calls(named, {"get_weather"})
    single = {"type": "any", "disable_parallel_tool_use": True}
    any_tool = client.messages.create(**ask, tools=TOOLS, tool_choice=single)
    check_message(any_tool, model)
    assert len(check_calls(any_tool, set(SCHEMAS))) == 1
    with client.messages.stream(**ask, tools=TOOLS, tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    check_message(streamed, model)
    check_calls(streamed, set(SCHEMAS))
    return calls


def check_tool_result_round_trip(client: anthropic.Anthropic, ask: dict, model: str, calls: list) -> None:
    """The calls answered with tool_result blocks: the conversation renders and the model answers."""
    history = [*ASK, {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})
                                                      for call in calls]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": json.dumps({"forecast": "sunny", "high_c": 21})}
                                            for call in calls]}]
    answer = client.messages.create(**{**ask, "messages": history}, tools=TOOLS)
    check_message(answer, model)


def check_thinking_disabled(client: anthropic.Anthropic, ask: dict, model: str) -> None:
    message = client.messages.create(**ask, thinking={"type": "disabled"})
    check_message(message, model)
    assert not any(block.type == "thinking" for block in message.content)


def check_count_tokens(client: anthropic.Anthropic, ask: dict) -> None:
    """count_tokens counts what /v1/messages runs: the same prompt, computed or read from the cache."""
    conversation = {key: value for key, value in ask.items() if key != "max_tokens"}
    counted = client.messages.count_tokens(**conversation, tools=TOOLS).input_tokens
    usage = client.messages.create(**ask, tools=TOOLS, tool_choice={"type": "any"}).usage
    assert counted == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0


def check_x_api_key(base_url: str, ask: dict, api_key: str, timeout_s: float) -> None:
    """The key as Anthropic's header (as Claude Code sends it): accepted; a wrong one refused in Anthropic's shape."""
    with httpx2.Client(base_url=base_url, timeout=timeout_s) as http:
        accepted = http.post("/v1/messages", json=ask, headers={"x-api-key": api_key})
        refused = http.post("/v1/messages", json=ask, headers={"x-api-key": api_key + "-wrong"})
    assert accepted.status_code == 200 and accepted.json()["type"] == "message", accepted.text
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
