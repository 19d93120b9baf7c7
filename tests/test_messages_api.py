"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) in process, over a scripted engine, with
the official `anthropic` client (and raw HTTP for the event stream and the error bodies).

Plain and streamed answers (the SDK's stream helper and the raw event order), thinking blocks from a reasoning
parser (and none, with nothing lost, when the client disables thinking), tool calls read by the Hermes parser
and forced through structured output, a tool_result conversation rendered as chat renders it, stop sequences,
max_tokens, a prefill, count_tokens, Anthropic's error shape on these paths (and OpenAI's elsewhere), and the
API key as `x-api-key`, checked before the body is read.
"""
from __future__ import annotations

import json

import anthropic
import pytest
from scripted_chat import text_pieces
from scripted_messages import MODEL, ScriptedMessagesEngine, run_messages
from server_harness import FakeEngine, serve_in_process
from test_harmony import REASONED, harmony_tokenizer, token_pieces
from test_server_hardening_http import LargeUpload, call_asgi, http_scope
from transformers import AutoTokenizer

from moe_runtime.errors import EngineDeadError
from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.server import build_app
from moe_runtime.server.auth import ApiKeys, request_key
from moe_runtime.server.errors import APIError
from moe_runtime.server.messages.content_blocks import BlockStream
from moe_runtime.server.protocol import DeltaFunctionCall, DeltaToolCall
from moe_runtime.server.startup_gate import starting_response
from moe_runtime.server.tool_calls.stream import StreamPiece

pytestmark = pytest.mark.timeout(60)

ASK = [{"role": "user", "content": "2+2?"}]
ANSWER = ["It is ", "4."]
THOUGHT = ["<th", "ink>\nThe user", " wants 2+2.</th", "ink>", "\n\n", "It is ", "4."]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time now.", "input_schema": {"type": "object", "properties": {}}}]
HERMES_CALL = ["Let me look.\n", "<tool_call>\n{\"name\": \"get_weather\", ",
               "\"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>"]
FORCED_CALL = ['[{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}]']
KEY = "sesame"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)


def engine_of(tokenizer, pieces, **kwargs) -> ScriptedMessagesEngine:
    return ScriptedMessagesEngine(tokenizer, text_pieces(pieces), **kwargs)


def request(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 64, "messages": ASK, **fields}


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; the name must be the data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append((lines["event"], data))
    return events


def check_event_order(events: list[tuple[str, dict]]) -> None:
    """message_start, then blocks each started, grown and stopped in turn (indices 0, 1, ...), then
    message_delta and message_stop; a thinking block's signature comes just before it stops."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index, last_delta = None, 0, None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index, kind = data["index"], next_index + 1, data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            last_delta = data["delta"]["type"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            assert (last_delta == "signature_delta") == (kind == "thinking")
            open_index, last_delta = None, None
    assert open_index is None


def streamed_text(events, delta_type: str, field: str) -> str:
    return "".join(data["delta"][field] for name, data in events
                   if name == "content_block_delta" and data["delta"]["type"] == delta_type)


# ---- answers ---------------------------------------------------------------------------------------------

def test_a_plain_answer_streamed_and_whole_with_the_sdk(tokenizer):
    engine = engine_of(tokenizer, ANSWER, cached_prompt_tokens=4)

    async def scenario(client, http):
        whole = await client.messages.create(**request())
        async with client.messages.stream(**request()) as stream:
            sdk_text = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        raw = await http.post("/v1/messages", json=request(stream=True))
        return whole, sdk_text, final, raw

    whole, sdk_text, final, raw = run_messages(engine, scenario)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == "It is 4." and whole.stop_reason == "end_turn" and whole.stop_sequence is None
    prompt = len(engine.prompts[0])
    assert whole.usage.input_tokens == prompt - 4 and whole.usage.cache_read_input_tokens == 4
    assert whole.usage.output_tokens == len(ANSWER) and whole.usage.cache_creation_input_tokens == 0
    assert sdk_text == "It is 4." and final.content[0].text == "It is 4." and final.stop_reason == "end_turn"
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert raw.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in raw.text
    events = sse_events(raw.text)
    check_event_order(events)
    assert [name for name, _ in events] == ["message_start", "content_block_start", *["content_block_delta"] * (
        len(events) - 5), "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == prompt
    assert streamed_text(events, "text_delta", "text") == "It is 4."
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == len(ANSWER)


def test_thinking_blocks_come_from_the_reasoning_parser(tokenizer):
    engine = engine_of(tokenizer, THOUGHT)

    async def scenario(client, http):
        whole = await client.messages.create(**request(thinking={"type": "enabled", "budget_tokens": 1024}))
        async with client.messages.stream(**request()) as stream:
            final = await stream.get_final_message()
        raw = await http.post("/v1/messages", json=request(stream=True))
        return whole, final, raw

    whole, final, raw = run_messages(engine, scenario, reasoning_parser="qwen3")
    for message in (whole, final):
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "\nThe user wants 2+2." and message.content[0].signature == ""
        assert message.content[1].text == "It is 4."
    events = sse_events(raw.text)
    check_event_order(events)
    assert streamed_text(events, "thinking_delta", "thinking") == "\nThe user wants 2+2."
    assert streamed_text(events, "text_delta", "text") == "It is 4."
    assert "think>" not in raw.text
    assert [data["content_block"]["type"] for name, data in events if name == "content_block_start"] == [
        "thinking", "text"]


def test_thinking_disabled_gives_no_thinking_block_and_loses_nothing(tokenizer):
    """deepseek_r1's parser reads the text as reasoning until </think> (its template opens the block); a template
    that ignores the switch leaves it so, and the answer would be lost with the thinking block: it is text."""
    engine = engine_of(tokenizer, ["Just ", "the answer."])

    async def scenario(client, http):
        whole = await client.messages.create(**request(thinking={"type": "disabled"}))
        raw = await http.post("/v1/messages", json=request(stream=True, thinking={"type": "disabled"}))
        thinking = await client.messages.create(**request())
        return whole, raw, thinking

    whole, raw, thinking = run_messages(engine, scenario, reasoning_parser="deepseek_r1")
    assert [(block.type, block.text) for block in whole.content] == [("text", "Just the answer.")]
    events = sse_events(raw.text)
    assert streamed_text(events, "text_delta", "text") == "Just the answer."
    assert not any(data.get("content_block", {}).get("type") == "thinking" for _, data in events)
    assert [block.type for block in thinking.content] == ["thinking"]   # the parser's reading, when thinking is on


def test_the_thinking_switch_reaches_the_template(tokenizer):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    tokenizer.chat_template = template
    engine = engine_of(tokenizer, ["Just content."])

    async def scenario(client, http):
        off = await client.messages.create(**request(thinking={"type": "disabled"}))
        await client.messages.create(**request(thinking={"type": "enabled", "budget_tokens": 2048}))
        return off

    off = run_messages(engine, scenario, reasoning_parser="qwen3")
    assert [block.type for block in off.content] == ["text"] and off.content[0].text == "Just content."
    assert tokenizer.decode(engine.prompts[0]).endswith("<think></think>")
    assert not tokenizer.decode(engine.prompts[1]).endswith("<think></think>")


def test_a_harmony_models_analysis_is_a_thinking_block_unless_thinking_is_disabled(tiny_tokenizer_dir):
    tokenizer = harmony_tokenizer(tiny_tokenizer_dir)
    engine = ScriptedMessagesEngine(tokenizer, token_pieces(tokenizer, REASONED))

    async def scenario(client, http):
        whole = await client.messages.create(**request())
        raw = await http.post("/v1/messages", json=request(stream=True))
        disabled = await client.messages.create(**request(thinking={"type": "disabled"}))
        prefill = await http.post("/v1/messages", json=request(messages=[*ASK, {"role": "assistant", "content": "2"}]))
        return whole, raw, disabled, prefill

    whole, raw, disabled, prefill = run_messages(engine, scenario, model_type="gpt_oss")
    assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None)) for block in whole.content] \
        == [("thinking", "User asks 2+2. Simple."), ("text", "2 + 2 = 4.")]
    events = sse_events(raw.text)
    check_event_order(events)
    assert streamed_text(events, "thinking_delta", "thinking") == "User asks 2+2. Simple."
    assert [(block.type, block.text) for block in disabled.content] == [("text", "2 + 2 = 4.")]
    assert prefill.status_code == 400 and "messages.1" in prefill.json()["error"]["message"]


# ---- tools -----------------------------------------------------------------------------------------------

def test_a_call_read_by_the_parser_is_a_tool_use_block(tokenizer):
    engine = engine_of(tokenizer, HERMES_CALL)

    async def scenario(client, http):
        whole = await client.messages.create(**request(tools=TOOLS))
        async with client.messages.stream(**request(tools=TOOLS)) as stream:
            final = await stream.get_final_message()
        raw = await http.post("/v1/messages", json=request(tools=TOOLS, stream=True))
        return whole, final, raw

    whole, final, raw = run_messages(engine, scenario)
    for message in (whole, final):
        assert [block.type for block in message.content] == ["text", "tool_use"]
        assert message.content[0].text == "Let me look.\n"
        call = message.content[1]
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        assert call.input == {"city": "Paris", "days": 2} and message.stop_reason == "tool_use"
    events = sse_events(raw.text)
    check_event_order(events)
    start = next(data["content_block"] for name, data in events
                 if name == "content_block_start" and data["content_block"]["type"] == "tool_use")
    assert start["name"] == "get_weather" and start["input"] == {} and start["id"].startswith("toolu_")
    assert json.loads(streamed_text(events, "input_json_delta", "partial_json")) == {"city": "Paris", "days": 2}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_choice_goes_through_structured_output(tokenizer, tool_choice):
    engine = engine_of(tokenizer, FORCED_CALL)

    async def scenario(client, http):
        whole = await client.messages.create(**request(tools=TOOLS, tool_choice=tool_choice))
        raw = await http.post("/v1/messages", json=request(tools=TOOLS, tool_choice=tool_choice, stream=True))
        return whole, raw

    whole, raw = run_messages(engine, scenario)   # no tool-call parser is needed
    assert [(block.type, block.name, block.input) for block in whole.content] == [
        ("tool_use", "get_weather", {"city": "Oslo"})]
    assert whole.stop_reason == "tool_use"
    schema = json.loads(engine.params[0].structured_output.json_schema)
    assert "get_weather" in json.dumps(schema) and ("get_time" in json.dumps(schema)) == (tool_choice["type"] == "any")
    if tool_choice.get("disable_parallel_tool_use"):
        assert schema.get("maxItems") == 1
    events = sse_events(raw.text)
    check_event_order(events)
    assert json.loads(streamed_text(events, "input_json_delta", "partial_json")) == {"city": "Oslo"}


def test_a_forced_call_cut_by_max_tokens_keeps_its_input_as_far_as_it_got(tokenizer):
    engine = engine_of(tokenizer, ['[{"name": "get_weather", ', '"arguments": {"city": "Os'], finish_reason="length")

    async def scenario(client, http):
        return await client.messages.create(**request(tools=TOOLS, tool_choice={"type": "any"}))

    message = run_messages(engine, scenario)
    assert message.stop_reason == "max_tokens"
    assert [(block.type, block.name) for block in message.content] == [("tool_use", "get_weather")]
    assert isinstance(message.content[0].input, dict)


def test_a_tool_conversation_renders_as_chat_renders_it(tokenizer):
    """tool_use and tool_result blocks, a system prompt and a thinking block: the same prompt tokens as the chat
    request a client would send for the same conversation."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I need the tool.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21C"}]},
            {"type": "text", "text": "Thanks. And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
    ]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21C"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]
    chat_tools = [{"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                    "parameters": tool["input_schema"]}} for tool in TOOLS]
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        body = request(messages=messages, system=[{"type": "text", "text": "Be brief."}], tools=TOOLS)
        answer = await client.messages.create(**body)
        counted = await client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.", tools=TOOLS)
        chat_answer = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat,
                                                                    "tools": chat_tools, "max_tokens": 64})
        return answer, counted, chat_answer.json()

    answer, counted, chat_answer = run_messages(engine, scenario)
    assert answer.content[0].text == "It is 4."
    assert engine.prompts[0] == engine.prompts[1]
    rendered = tokenizer.decode(engine.prompts[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "Sunny, 21C" in rendered and "opaque" not in rendered
    assert counted.input_tokens == len(engine.prompts[0]) == chat_answer["usage"]["prompt_tokens"]


def test_a_tool_result_with_is_error_tells_the_model(tokenizer):
    engine = engine_of(tokenizer, ANSWER)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather",
                                                   "input": {"city": "Nowhere"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "is_error": True,
                                              "content": "no such city"}]}]

    async def scenario(client, http):
        return await client.messages.create(**request(messages=messages, tools=TOOLS))

    run_messages(engine, scenario)
    assert "Error: no such city" in tokenizer.decode(engine.prompts[0])


# ---- stopping, prefill, counting -------------------------------------------------------------------------

def test_a_stop_sequence_is_named_and_max_tokens_is_max_tokens(tokenizer):
    stopped = engine_of(tokenizer, ANSWER, stop_string="END")
    cut = engine_of(tokenizer, ANSWER, finish_reason="length")

    async def stop_scenario(client, http):
        whole = await client.messages.create(**request(stop_sequences=["END", "\n\nHuman:"]))
        raw = await http.post("/v1/messages", json=request(stop_sequences=["END"], stream=True))
        return whole, raw

    async def cut_scenario(client, http):
        return await client.messages.create(**request(max_tokens=2))

    whole, raw = run_messages(stopped, stop_scenario)
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == "END"
    assert stopped.params[0].stop == ["END", "\n\nHuman:"]
    assert sse_events(raw.text)[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    message = run_messages(cut, cut_scenario)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert cut.params[0].max_tokens == 2


def test_sampling_settings_reach_the_engine(tokenizer):
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        # anthropic 2.x's create() has no temperature, top_p or top_k: older clients send them, so they are served
        return await client.messages.create(**request(metadata={"user_id": "u-1"}),
                                            extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 7})

    run_messages(engine, scenario)
    params = engine.params[0]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.3, 0.9, 7, 64)


def test_a_final_assistant_message_is_continued(tokenizer):
    engine = engine_of(tokenizer, ["B)"])
    prefill = [{"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
               {"role": "assistant", "content": "The best answer is ("}]

    async def scenario(client, http):
        return await client.messages.create(**request(messages=prefill))

    message = run_messages(engine, scenario)
    assert message.content[0].text == "B)"
    rendered = tokenizer.decode(engine.prompts[0])
    assert rendered.endswith("The best answer is (")


def test_count_tokens_counts_the_prompt_the_answer_runs_with(tokenizer):
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        counted = await client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.",
                                                     tools=TOOLS, tool_choice={"type": "any"})
        await http.post("/v1/messages", json=request(system="Be brief.", tools=TOOLS, tool_choice={"type": "any"}))
        plain = await http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK})
        chat = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        return counted, plain.json(), chat.json()

    counted, plain, chat = run_messages(engine, scenario)
    assert counted.input_tokens == len(engine.prompts[0])
    assert plain == {"input_tokens": chat["usage"]["prompt_tokens"]} and plain["input_tokens"] < counted.input_tokens
    assert len(engine.prompts) == 2   # counting generates nothing


# ---- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, named", [
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    (request(max_tokens=0), "max_tokens"),
    (request(temperature="hot"), "temperature"),
    (request(messages=[]), "messages"),
    (request(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (request(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]),
     "messages.0.content"),
    (request(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages.0.content"),
    (request(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
    (request(tools=[{"name": "bad name!", "input_schema": {}}]), "tools.0.name"),
    (request(tools=TOOLS, tool_choice={"type": "tool"}), "tool_choice.name"),
    (request(tools=TOOLS, tool_choice={"type": "tool", "name": "nowhere"}), "tool_choice"),
    (request(stop_sequences=[""]), "stop_sequences"),
    (request(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]}]), "messages.1"),
    (request(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_time",
                                                      "input": {}}]}]), "messages.0.content.0"),
])
def test_a_bad_request_is_a_400_in_anthropics_shape_naming_the_field(tokenizer, body, named):
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        raw = await http.post("/v1/messages", json=body)
        try:
            await client.messages.create(**{key: value for key, value in body.items() if key != "temperature"},
                                         extra_body={"temperature": body["temperature"]} if "temperature" in body
                                         else None)
        except anthropic.BadRequestError as exc:
            return raw, exc
        except TypeError:   # the SDK refuses it before sending (a missing required argument)
            return raw, TypeError
        return raw, None

    raw, sdk_error = run_messages(engine, scenario)
    assert raw.status_code == 400, raw.text
    error = raw.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and named in error["error"]["message"]
    assert sdk_error is TypeError or sdk_error.body == error
    assert engine.prompts == []


def test_other_errors_on_the_messages_paths_are_in_anthropics_shape(tokenizer):
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        unknown_model = await http.post("/v1/messages", json=request(model="claude-opus-4"))
        count_unknown = await http.post("/v1/messages/count_tokens", json={"model": "claude-opus-4", "messages": ASK})
        no_route = await http.post("/v1/messages/batches", json={})
        wrong_method = await http.get("/v1/messages")
        too_large = await http.post("/v1/messages", content=b"{" + b" " * 3000 + b"}",
                                    headers={"Content-Type": "application/json"})
        not_json = await http.post("/v1/messages", content=b"{", headers={"Content-Type": "application/json"})
        chat_unknown = await http.post("/v1/chat/completions", json={"model": "claude-opus-4", "messages": ASK})
        try:
            await client.messages.create(**request(model="claude-opus-4"))
        except anthropic.NotFoundError as exc:
            sdk_error = exc
        return unknown_model, count_unknown, no_route, wrong_method, too_large, not_json, chat_unknown, sdk_error

    unknown_model, count_unknown, no_route, wrong_method, too_large, not_json, chat_unknown, sdk_error = run_messages(
        engine, scenario, max_request_bytes=2048)
    expected = [(unknown_model, 404, "not_found_error"), (count_unknown, 404, "not_found_error"),
                (no_route, 404, "not_found_error"), (wrong_method, 405, "invalid_request_error"),
                (too_large, 413, "request_too_large"), (not_json, 400, "invalid_request_error")]
    for response, status, kind in expected:
        assert response.status_code == status and response.json()["type"] == "error", response.text
        assert response.json()["error"]["type"] == kind and response.json()["error"]["message"]
    assert "claude-opus-4" in unknown_model.json()["error"]["message"]
    assert chat_unknown.status_code == 404 and chat_unknown.json()["error"]["code"] == "model_not_found"   # OpenAI's
    assert sdk_error.status_code == 404 and sdk_error.body["error"]["type"] == "not_found_error"


def test_anthropic_error_types_follow_the_status():
    types = {status: APIError(status, "m").anthropic_body()["error"]["type"]
             for status in (400, 401, 403, 404, 405, 413, 422, 429, 499, 500, 502, 503)}
    assert types == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                     422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                     500: "api_error", 502: "api_error", 503: "overloaded_error"}
    error = APIError(429, "the queue is full")
    assert error.body_for("/v1/messages") == {"type": "error", "error": {"type": "rate_limit_error",
                                                                         "message": "the queue is full"}}
    assert error.body_for("/v1/messages/count_tokens")["type"] == "error"
    assert "type" not in error.body_for("/v1/messagesx") and "type" not in error.body_for("/v1/chat/completions")
    starting = starting_response("/v1/messages", "POST")   # moe-serve before its engine is ready
    assert starting.status_code == 503 and json.loads(starting.body)["error"]["type"] == "overloaded_error"
    assert "type" not in json.loads(starting_response("/v1/chat/completions", "POST").body)


class DyingEngine(ScriptedMessagesEngine):
    """Dies at its second step, mid-answer."""

    def step(self):
        if self.steps >= 1:
            raise EngineDeadError("rank 1 died in 10.0.0.7 (fake)")
        self.steps += 1
        return super().step()


def test_a_stream_that_fails_ends_with_anthropics_error_event(tokenizer):
    engine = DyingEngine(tokenizer, text_pieces(["It ", "is ", "4."]))

    async def scenario(client, http):
        raw = await http.post("/v1/messages", json=request(stream=True))
        return raw

    raw = run_messages(engine, scenario)
    name, data = sse_events(raw.text)[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error",
                                                                   "message": "the engine is unavailable"}}
    assert "10.0.0.7" not in raw.text


def test_a_sdk_stream_raises_on_the_error_event(tokenizer):
    engine = DyingEngine(tokenizer, text_pieces(["It ", "is ", "4."]))

    async def scenario(client, http):
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with client.messages.stream(**request()) as stream:
                async for _ in stream:
                    pass
        return caught.value

    error = run_messages(engine, scenario)
    assert error.body == {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": "the engine is unavailable"}}


# ---- the API key as x-api-key ----------------------------------------------------------------------------

def test_the_key_works_as_x_api_key_and_a_wrong_one_is_refused(tokenizer):
    engine = engine_of(tokenizer, ANSWER)

    async def scenario(client, http):
        as_x_api_key = await client.messages.create(**request())   # the SDK sends only x-api-key here
        statuses = {}
        for name, headers in {"x-api-key": {"x-api-key": KEY}, "bearer": {"Authorization": f"Bearer {KEY}"},
                              "wrong x-api-key": {"x-api-key": "open sesame"}, "none": {},
                              "empty x-api-key": {"x-api-key": " "}}.items():
            statuses[name] = (await http.post("/v1/messages", json=request(), headers=headers))
        models = await http.get("/v1/models", headers={"x-api-key": KEY})
        chat_wrong = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK},
                                     headers={"x-api-key": "nope"})
        return as_x_api_key, statuses, models, chat_wrong

    message, statuses, models, chat_wrong = run_messages(engine, scenario, client_key=None,
                                                         client_headers={"x-api-key": KEY}, api_key=KEY)
    assert message.content[0].text == "It is 4."
    assert statuses["x-api-key"].status_code == 200 and statuses["bearer"].status_code == 200
    for name in ("wrong x-api-key", "none", "empty x-api-key"):
        refused = statuses[name]
        assert refused.status_code == 401 and refused.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": refused.json()["error"]["message"]}}
        assert "x-api-key" in refused.json()["error"]["message"]
    assert models.status_code == 200   # every route takes it
    assert chat_wrong.status_code == 401 and chat_wrong.json()["error"]["code"] == "invalid_api_key"   # OpenAI's
    assert len(engine.prompts) == 3


def test_a_wrong_sdk_key_is_an_authentication_error(tokenizer):
    async def scenario(client, http):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await client.messages.create(**request())
        return caught.value

    error = run_messages(engine_of(tokenizer, ANSWER), scenario, client_key="wrong", api_key=KEY)
    assert error.status_code == 401 and error.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("framing", [{"Content-Length": str(16 * 2**20)}, {"Transfer-Encoding": "chunked"}])
@pytest.mark.parametrize("key", [{}, {"x-api-key": "wrong"}])
def test_the_x_api_key_is_checked_before_the_body_is_read(framing, key):
    app = build_app(AsyncEngine(FakeEngine()), "fake", api_key=KEY)
    upload = LargeUpload()
    status, headers, body = call_asgi(app, http_scope("POST", "/v1/messages", {
        "Content-Type": "application/json", **key, **framing}), upload)
    assert status == 401 and upload.calls == 0
    assert json.loads(body)["error"]["type"] == "authentication_error" and headers["connection"] == "close"


def test_a_request_presents_its_authorization_key_first_then_its_x_api_key():
    assert request_key("Bearer a", "b") == "a"
    assert request_key("", "b") == "b" and request_key("Token a", " b ") == "b"
    assert request_key("", None) is None and request_key("", "  ") is None
    keys = ApiKeys.of(["tenant-0", "tenant-1"])
    assert keys.identify(request_key("", "tenant-1")) == 1 and keys.identify(request_key("", "other")) is None


def test_the_admin_key_works_as_x_api_key():
    async def scenario(client, _):
        tenant = await client.post("/reset_prefix_cache", headers={"x-api-key": "tenant-0"})
        admin = await client.post("/reset_prefix_cache", headers={"x-api-key": "root"})
        return tenant.status_code, admin.status_code

    assert serve_in_process(FakeEngine(), scenario, api_key=["tenant-0", "tenant-1"], admin_key="root") == (403, 200)


# ---- the block stream on its own -------------------------------------------------------------------------

def test_a_new_block_opens_whenever_the_kind_changes_and_blank_text_opens_none():
    blocks = BlockStream(new_tool_use_id=lambda: "toolu_x")
    call = DeltaToolCall(index=0, id="call_0", type="function", function=DeltaFunctionCall(name="f", arguments=""))
    pieces = [StreamPiece(reasoning="r1"), StreamPiece(content="\n\n"), StreamPiece(reasoning="r2"),
              StreamPiece(content="\n"), StreamPiece(content="text"), StreamPiece(content="\n", tool_calls=[call]),
              StreamPiece(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}'))])]
    events = [event for piece in pieces for event in blocks.events(piece, thinking=True)] + blocks.close()
    starts = [event["content_block"]["type"] for event in events if event["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]   # r1 and r2: one thinking block (blank lines open none)
    texts = [e["delta"]["text"] for e in events if e.get("delta", {}).get("type") == "text_delta"]
    assert texts == ["\n\n\ntext", "\n"]   # held whitespace leads the text it waited for
    assert [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"] == [
        '{"a": 1}']
    hidden = BlockStream()
    assert [event for event in hidden.events(StreamPiece(reasoning="r"), thinking=False)] == []
