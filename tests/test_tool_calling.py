"""Tool calling end to end, with the official `openai` client and LangChain's `bind_tools`.

- The real `moe-serve` on the embedded demo model (random weights; one server for the module):
  `tool_choice` required and named go through structured output, so even this model returns calls
  whose arguments validate against the tool's schema, streamed and not; the history of a tool
  conversation is rendered through the demo's chat template.
- The app in process over a scripted engine that answers with a known text: `tool_choice` auto
  read by the Hermes parser, streamed as OpenAI tool-call deltas.
"""
import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from server_harness import FakeEngine, ServerProcess
from transformers import AutoTokenizer

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.records.outputs import RequestOutput
from moe_runtime.server import build_app

pytestmark = pytest.mark.timeout(300)

API_KEY = "tool-key"
MODEL = "moe-runtime-demo"
MAX_TOKENS = 400   # the demo's calls take 40-250 tokens (JSON whitespace is bounded by the grammar)
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "detailed": {"type": "boolean"}},
    "required": ["unit", "days", "detailed"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for the user's city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What will the weather be like?"}]


@pytest.fixture(scope="module")
def server(demo_model):
    """`moe-serve` on the demo model (the session's private build), under the name it serves by default."""
    process = ServerProcess(["--model", str(demo_model), "--served-model-name", MODEL, "--device", "cpu",
                             "--api-key", API_KEY, "--max-num-seqs", "4", "--log-level", "warning"],
                            startup_timeout_s=240)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(API_KEY, timeout=120)


def assert_valid_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    """Each (name, arguments JSON) names an offered function and its arguments validate against its schema."""
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], list[str], str]:
    """The calls a streaming client assembles from tool-call deltas, the finish reasons and the content."""
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                if delta.id:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    call["id"] = delta.id
                    assert delta.type == "function" and delta.function.name
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert all(call["id"] for call in calls.values())
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], reasons, content


def test_named_tool_choice_returns_a_valid_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=1,
                                           max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert [call.type for call in choice.message.tool_calls] == ["function"]
    assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], {"get_weather"})
    assert choice.message.tool_calls[0].id.startswith("call_")

    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=1,
                                            max_tokens=MAX_TOKENS, stream=True)
    calls, reasons, content = streamed_calls(stream)
    assert reasons == ["tool_calls"] and content == ""
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]   # same seed


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_returns_valid_calls_streamed_and_not(client, parallel):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=5, max_tokens=MAX_TOKENS,
                   parallel_tool_calls=parallel)
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert_valid_calls(calls, {"get_weather", "get_time"})
    if not parallel:
        assert len(calls) == 1
    streamed, reasons, _ = streamed_calls(client.chat.completions.create(**request, stream=True))
    assert reasons == ["tool_calls"] and streamed == calls


def test_langchain_bind_tools_named_and_required(server):
    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS, seed=3,
                     max_retries=0, timeout=120)
    named = llm.bind_tools(TOOLS, tool_choice="get_weather")
    message = named.invoke("What will the weather be like?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)

    required = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)   # LangChain's "any" = required
    merged = None
    for chunk in required.stream("What time is it?"):
        merged = chunk if merged is None else merged + chunk
    assert isinstance(merged, AIMessageChunk) and len(merged.tool_calls) == 1
    call = merged.tool_calls[0]
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_auto_on_the_demo_model_answers_with_content_or_valid_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        assert_valid_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                           {"get_weather", "get_time"})
    else:
        assert choice.message.content


def test_tool_conversation_history_is_rendered_through_the_chat_template(server, client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"unit": "celsius", "days": 2, "detailed": false}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    with server.http_client(API_KEY) as http:
        tokens = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '"name": "get_time"' in text                                 # the tools, shown to the model
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2, "detailed": false}}' \
           "\n</tool_call>" in text                                    # the earlier call, arguments as an object
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=4)
    assert reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens < len(tokens)   # "none" renders no tools


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS * 65}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_refused_naming_the_parameter(server, body, param):
    response = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": ASK, **body},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- tool_choice auto, read from a known answer (in process) -----------------------------------------------

KNOWN_ANSWER = ['Let me', ' check.\n<tool', '_call>\n{"name": "get_weather", ', '"arguments": {"unit": "cel',
                'sius", "days": 3', ', "detailed": true}}\n</tool_call>', '\n<tool_call>\n{"name": "get_time", ',
                '"arguments": {}}\n</tool_call>']


class ScriptedEngine(FakeEngine):
    """Answers every request with the pieces of `answer` (`KNOWN_ANSWER`), one per step, then ends with
    `finish_reason`."""

    def __init__(self, tokenizer, answer: list[str] = KNOWN_ANSWER, finish_reason: str = "stop"):
        super().__init__(vocab_size=len(tokenizer))
        self.tokenizer = tokenizer
        self.answer = answer
        self.finish_reason = finish_reason

    def step(self) -> list[RequestOutput]:
        while self.waiting:
            self.running.append(self.waiting.popleft())
        outputs = []
        for request in list(self.running):
            piece = self.answer[len(request.tokens)]
            request.tokens.append(1)
            finished = len(request.tokens) == len(self.answer)
            if finished:
                self.running.remove(request)
            outputs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt, token_ids=list(request.tokens),
                text="".join(self.answer[:len(request.tokens)]), finished=finished,
                finish_reason=self.finish_reason if finished else None, new_token_ids=[1], new_text=piece))
        return outputs


def with_openai_client(tokenizer_dir, scenario, answer: list[str] = KNOWN_ANSWER, finish_reason: str = "stop"):
    """`await scenario(AsyncOpenAI)` against the app on a `ScriptedEngine` (ASGI transport, one event loop)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    async def main():
        async_engine = AsyncEngine(ScriptedEngine(tokenizer, answer, finish_reason), AsyncEngineConfig()).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "scripted"))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as http:
                return await scenario(openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http,
                                                         max_retries=0))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_auto_reads_the_models_calls_streamed_as_openai_deltas_and_whole(tiny_tokenizer_dir):
    async def scenario(client):
        whole = await client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
        stream = await client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True)
        return whole, [chunk async for chunk in stream]

    whole, chunks = with_openai_client(tiny_tokenizer_dir, scenario)
    expected = [("get_weather", '{"unit": "celsius", "days": 3, "detailed": true}'), ("get_time", "{}")]
    message = whole.choices[0].message
    assert message.content == "Let me check.\n" and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected

    calls, reasons, content = streamed_calls(chunks)
    assert (calls, reasons, content) == (expected, ["tool_calls"], "Let me check.\n")
    assert not any("<tool" in (ch.delta.content or "") for c in chunks for ch in c.choices)


def test_the_openai_stream_helper_assembles_streamed_calls(tiny_tokenizer_dir):
    """openai-python's `chat.completions.stream()` merges deltas and asserts on what it gets: after a call's
    first delta, fields OpenAI omits (id, type, name) must be absent, not null."""
    async def scenario(client):
        async with client.chat.completions.stream(model="scripted", messages=ASK, tools=TOOLS) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_completion()
        raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=ASK, tools=TOOLS,
                                                                     stream=True)
        lines = [line async for line in raw.http_response.aiter_lines()]
        return events, final, lines

    events, final, lines = with_openai_client(tiny_tokenizer_dir, scenario)
    message = final.choices[0].message
    assert [call.type for call in message.tool_calls] == ["function", "function"]   # not overwritten by nulls
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"unit": "celsius", "days": 3, "detailed": true}'), ("get_time", "{}")]
    assert "get_weather" in [e.name for e in events if e.type == "tool_calls.function.arguments.done"]
    deltas = [call for line in lines if line.startswith("data: {")
              for choice in json.loads(line[6:])["choices"] for call in choice["delta"].get("tool_calls") or []]
    firsts = [d for d in deltas if "id" in d]
    assert len(firsts) == 2 and all(d["type"] == "function" and d["function"]["name"] for d in firsts)
    later = [d for d in deltas if "id" not in d]
    assert later and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in later)
    assert not any(value is None for d in deltas for value in (*d.values(), *d["function"].values()))


FORCED_CUT = ['[{"name": "get_weather", ', '"arguments": {"unit": "cel']   # max_tokens ended it here


@pytest.mark.parametrize("cut", [FORCED_CUT, FORCED_CUT[:1], ['[{"na']], ids=["in-arguments", "after-name",
                                                                                 "in-name"])
def test_a_forced_call_cut_by_max_tokens_never_becomes_content(tiny_tokenizer_dir, cut):
    async def scenario(client):
        request = dict(model="scripted", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
        whole = await client.chat.completions.create(**request)
        chunks = [chunk async for chunk in await client.chat.completions.create(**request, stream=True)]
        return whole, chunks

    whole, chunks = with_openai_client(tiny_tokenizer_dir, scenario, answer=cut, finish_reason="length")
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    streamed_content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert streamed_content == ""
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]
    announced = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if d.id]
    assert [d.function.name for d in announced] == ([] if cut == ['[{"na'] else ["get_weather"])
    # the whole answer shows what the stream showed: the call as far as it got (the client sees "length")
    assert [c.function.name for c in choice.message.tool_calls or []] == [d.function.name for d in announced]
