"""The Responses API in process (scripted model text): the official openai client's `responses.create`,
`.stream`, tools (auto through a parser, forced), reasoning items, `previous_response_id` over the bounded
per-key store, structured output, background responses, and refusals that name the field."""
import asyncio
import json

import pytest
from scripted_chat import ScriptedChatEngine, run_chat, text_pieces
from transformers import AutoTokenizer

from moe_runtime.server.protocol import ChatMessage
from moe_runtime.server.responses.store import ResponseStore

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def run(tokenizer_dir, pieces, scenario, finish_reason="stop", **app_kwargs):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    engine = ScriptedChatEngine(tokenizer, text_pieces(pieces), finish_reason=finish_reason)
    return run_chat(engine, scenario, **app_kwargs), engine, tokenizer


def events_of(text: str) -> list[dict]:
    """A Responses event stream's events: each `event: NAME` line names the `data:` line's type."""
    events, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == name
            events.append(event)
    return events


def test_plain_and_streamed_answers_agree(tiny_tokenizer_dir):
    async def scenario(client, http):
        whole = await client.responses.create(model="scripted", input="Say hi", instructions="Be brief.")
        async with client.responses.stream(model="scripted", input="Say hi") as stream:
            deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        raw = await http.post("/v1/responses", json={"model": "scripted", "input": "Say hi", "stream": True})
        return whole, deltas, final, raw

    (whole, deltas, final, raw), engine, tokenizer = run(tiny_tokenizer_dir, ["Hel", "lo", " there."], scenario)
    assert whole.output_text == final.output_text == "".join(deltas) == "Hello there."
    assert whole.status == "completed" and whole.id.startswith("resp_") and whole.object == "response"
    assert whole.usage.input_tokens == len(engine.prompts[0]) and whole.usage.output_tokens == 3
    assert whole.usage.input_tokens_details.cached_tokens == 0
    assert whole.instructions == "Be brief." and "Be brief." in tokenizer.decode(engine.prompts[0])
    events = events_of(raw.text)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert "data: [DONE]" not in raw.text


def test_a_call_read_by_the_parser_is_a_function_call_item_streamed_and_whole(tiny_tokenizer_dir):
    text = ['Checking.<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']

    async def scenario(client, http):
        whole = await client.responses.create(model="scripted", input="Weather?", tools=[WEATHER, CLOCK])
        async with client.responses.stream(model="scripted", input="Weather?", tools=[WEATHER, CLOCK]) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        return whole, kinds, final

    (whole, kinds, final), _, _ = run(tiny_tokenizer_dir, text, scenario, tool_call_parser="hermes")
    for answer in (whole, final):
        assert [item.type for item in answer.output] == ["message", "function_call"]
        call = answer.output[1]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert call.call_id and call.id.startswith("fc_") and answer.output_text == "Checking."
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_required_tool_choice_forces_the_calls(tiny_tokenizer_dir):
    text = ['[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]']

    async def scenario(client, http):
        return await client.responses.create(model="scripted", input="Both", tools=[WEATHER, CLOCK],
                                             tool_choice="required")

    answer, engine, _ = run(tiny_tokenizer_dir, text, scenario)
    assert [(item.type, item.name) for item in answer.output] == [("function_call", "get_time"),
                                                                  ("function_call", "get_weather")]
    assert engine.params[0].structured_output is not None   # the grammar holds the answer to the tools' schemas


def test_previous_response_id_continues_the_conversation_per_key(tiny_tokenizer_dir):
    text = ['[{"name": "get_weather", "arguments": {"city": "Lima"}}]']

    async def scenario(client, http):
        first = await client.responses.create(model="scripted", input="Weather in Lima?", tools=[WEATHER],
                                              tool_choice={"type": "function", "name": "get_weather"})
        call = first.output[0]
        second = await client.responses.create(
            model="scripted", previous_response_id=first.id, tools=[WEATHER], tool_choice="required",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        other_key = await http.post("/v1/responses", headers={"Authorization": "Bearer key-b"},
                                    json={"input": "x", "previous_response_id": first.id})
        unknown = await http.post("/v1/responses", headers={"Authorization": "Bearer key-a"},
                                  json={"input": "x", "previous_response_id": "resp_nope"})
        fetched = await http.get(f"/v1/responses/{first.id}", headers={"Authorization": "Bearer key-a"})
        fetched_by_other = await http.get(f"/v1/responses/{first.id}", headers={"Authorization": "Bearer key-b"})
        return first, second, other_key, unknown, fetched, fetched_by_other

    async def with_key(client, http):
        http.headers["Authorization"] = "Bearer key-a"
        client = client.with_options(api_key="key-a")
        return await scenario(client, http)

    (first, second, other_key, unknown, fetched, fetched_by_other), engine, tokenizer = run(
        tiny_tokenizer_dir, text, with_key, api_key=["key-a", "key-b"])
    followed = tokenizer.decode(engine.prompts[1])
    assert "Weather in Lima?" in followed and "sunny, 21 C" in followed and "Lima" in followed
    assert len(engine.prompts[1]) > len(engine.prompts[0])
    assert second.previous_response_id == first.id
    for refused in (other_key, unknown):   # another tenant's id is as unknown as a made-up one
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"
    assert fetched.status_code == 200 and fetched.json()["id"] == first.id
    assert fetched_by_other.status_code == 404


def test_reasoning_is_a_reasoning_item_and_never_content(tiny_tokenizer_dir):
    async def scenario(client, http):
        whole = await client.responses.create(model="scripted", input="2+2?", reasoning={"effort": "high"})
        raw = await http.post("/v1/responses", json={"input": "2+2?", "stream": True})
        return whole, raw

    (whole, raw), _, _ = run(tiny_tokenizer_dir, ["<think>", "Add them.", "</think>", "\n\n4."], scenario,
                             reasoning_parser="qwen3")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Add them." and whole.output_text == "4."
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = events_of(raw.text)
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, content) == ("Add them.", "4.")


def test_effort_none_turns_thinking_off_in_the_template(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    engine = ScriptedChatEngine(tokenizer, text_pieces(["Just content."]))

    async def scenario(client, http):
        return await client.responses.create(model="scripted", input="hi", reasoning={"effort": "none"})

    answer = run_chat(engine, scenario, reasoning_parser="deepseek_r1")
    assert tokenizer.decode(engine.prompts[0]).endswith("<think></think>")
    # deepseek_r1 starts in the reasoning by default; the prompt closed the block, so this is content
    assert [item.type for item in answer.output] == ["message"] and answer.output_text == "Just content."


def test_structured_output_and_a_cut_answer(tiny_tokenizer_dir):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def scenario(client, http):
        return await client.responses.create(
            model="scripted", input="n?", max_output_tokens=2,
            text={"format": {"type": "json_schema", "name": "n", "schema": schema}})

    answer, engine, _ = run(tiny_tokenizer_dir, ['{"n":', ' 4}'], scenario, finish_reason="length")
    assert engine.params[0].structured_output is not None and engine.params[0].max_tokens == 2
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.text.format.type == "json_schema"


def test_store_false_is_not_kept_and_delete_forgets(tiny_tokenizer_dir):
    async def scenario(client, http):
        kept = await client.responses.create(model="scripted", input="a")
        unkept = await client.responses.create(model="scripted", input="b", store=False)
        fetched = await client.responses.retrieve(kept.id)
        missing = await http.get(f"/v1/responses/{unkept.id}")
        deleted = await http.delete(f"/v1/responses/{kept.id}")
        gone = await http.get(f"/v1/responses/{kept.id}")
        return kept, fetched, missing, deleted, gone

    (kept, fetched, missing, deleted, gone), _, _ = run(tiny_tokenizer_dir, ["ok"], scenario)
    assert fetched.output_text == kept.output_text == "ok"
    assert missing.status_code == 404 and deleted.json()["deleted"] is True and gone.status_code == 404


def test_a_background_response_is_fetched_when_done(tiny_tokenizer_dir):
    async def scenario(client, http):
        started = await client.responses.create(model="scripted", input="a", background=True)
        for _ in range(200):
            polled = await client.responses.retrieve(started.id)
            if polled.status not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.02)
        refused = await http.post("/v1/responses", json={"input": "a", "background": True, "store": False})
        return started, polled, refused

    (started, polled, refused), _, _ = run(tiny_tokenizer_dir, ["done", " later"], scenario)
    assert started.status == "in_progress" and started.output == []
    assert polled.status == "completed" and polled.output_text == "done later"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "stop": [""]}, "stop"),
    ({"input": [], "max_output_tokens": 5}, "input"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),   # the context rule, in this API's names
])
def test_refusals_name_the_field(tiny_tokenizer_dir, body, param):
    async def scenario(client, http):
        return await http.post("/v1/responses", json=body)

    answer, _, _ = run(tiny_tokenizer_dir, ["x"], scenario)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_the_store_is_bounded_by_bytes_expires_and_keeps_tenants_apart():
    now = [0.0]
    store = ResponseStore(max_bytes=100, ttl_s=10, clock=lambda: now[0])
    message = [ChatMessage(role="user", content="hi")]
    assert store.put(None, "a", message, {"id": "a"}, 40) and store.put(None, "b", message, {"id": "b"}, 40)
    assert store.put(None, "c", message, {"id": "c"}, 40)   # over budget: the oldest goes
    assert store.get(None, "a") is None and store.get(None, "b") is not None and store.stored_bytes == 80
    assert not store.put(None, "huge", message, {}, 101) and store.get(None, "huge") is None
    assert store.put(1, "t", message, {"id": "t"}, 10) and store.get(2, "t") is None and store.get(1, "t")
    now[0] = 11.0
    assert store.get(None, "c") is None and len(store) == 0 and store.stored_bytes == 0
