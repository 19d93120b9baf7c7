"""The real `moe-serve --ep 2 --dp-attn 2` on a tiny MoE checkpoint, driven with the openai client:
greedy answers equal the one-rank `LLM` API's, concurrent clients land on both DP workers, a
disconnected stream frees its KV blocks, and the expert load is served. The agents' APIs run here unchanged
too: the openai client's Responses calls, an OpenAI Agents SDK loop with two tools, and the anthropic
client's Messages calls (`tests/README.md`: the clients table).

The checkpoint's chat template opens a `<think>` block when a request asks for thinking (as DeepSeek-V3.1's
and Kimi-K2-Thinking's do), and the server reads reasoning with `--reasoning-parser qwen3`: a request that does
not ask renders and answers exactly as before."""
import json
import shutil
import socket
from typing import Annotated
import threading
import time

import agents
import anthropic
import httpx
import openai
import pydantic
import pytest
from anthropic_checks import check_messages_api
from server_harness import ServerProcess

from moe_runtime import LLM, SamplingParams
from moe_runtime.server.metrics import parse_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "tiny-ep"


GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
THINKING_PROMPT = ("{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% if thinking is defined and thinking %}{{ '<think>\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """The shared tiny checkpoint, copied with a chat template that opens the reasoning when asked to think, and
    a context of 2,048 tokens (an agent's conversation with two tools' definitions outgrows 512)."""
    shared = tiny_checkpoint_factory("qwen3_moe")
    copy = tmp_path_factory.mktemp("thinking-template") / "qwen3_moe"
    shutil.copytree(shared, copy)
    template = (copy / "chat_template.jinja").read_text()
    assert GENERATION_PROMPT in template
    (copy / "chat_template.jinja").write_text(template.replace(GENERATION_PROMPT, THINKING_PROMPT))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return copy


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "2", "--dp-attn", "2",
                             "--served-model-name", MODEL, "--kv-cache-memory", "16M", "--log-level", "warning",
                             "--reasoning-parser", "qwen3"])
    process.start()
    yield process
    assert process.stop() == 0, process.tail()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), device="cpu") as offline:  # one rank: the layout must not change the answer
        yield offline


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def metrics(base_url: str) -> dict[str, float]:
    return parse_samples(httpx.get(base_url + "/metrics", timeout=30).text)


def test_completions_and_chat_equal_one_rank(server, llm):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt = "def fibonacci(n):"
    [expected] = llm.generate([prompt], greedy(12))
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == expected.text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    [chat_expected] = llm.generate([chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]], greedy(10))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == chat_expected.text


def test_concurrent_clients_use_both_dp_workers(server, llm):
    prompts = [[7, 8, 9], list(range(30, 70)), [400, 12, 12, 12], [77], list(range(100, 112)), [5, 6]]
    expected = [o.text for o in llm.generate(prompts, greedy(16))]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        own = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = own.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert [results.get(i) for i in range(len(prompts))] == expected
    # the served snapshot is refreshed at most once a second (scrapes never pause the ranks)
    deadline = time.monotonic() + 10
    load = httpx.get(server.base_url + "/v1/expert_load", timeout=30).json()
    while sum(sum(row) for row in load["counts"]) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        load = httpx.get(server.base_url + "/v1/expert_load", timeout=30).json()
    assert sum(sum(row) for row in load["counts"]) > 0
    assert len(load["rank_load"][0]) == 2


def test_disconnect_frees_kv_blocks_on_every_worker(server):
    free = ['moe_kv_blocks_free{dp_rank="0"}', 'moe_kv_blocks_free{dp_rank="1"}']
    start = metrics(server.base_url)
    body = {"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            chunks = 0
            while chunks < 3:
                chunks += next(lines).startswith("data: ")
            deadline = time.monotonic() + 10
            while sum(metrics(server.base_url)[n] for n in free) == sum(start[n] for n in free):
                assert time.monotonic() < deadline, "the metrics never showed the stream's KV blocks in use"
                time.sleep(0.1)
    deadline = time.monotonic() + 20
    while True:
        now = metrics(server.base_url)
        if all(now[name] == start[name] for name in free):
            break
        assert time.monotonic() < deadline, f"KV blocks not released: {[now[n] for n in free]} vs start"
        time.sleep(0.1)


def _kv_free(server) -> float:
    samples = metrics(server.base_url)
    return sum(samples[f'moe_kv_blocks_free{{dp_rank="{dp}"}}'] for dp in (0, 1))


def test_a_plain_request_whose_client_leaves_is_aborted(server):
    """Not streamed: the front notices the disconnect (the ASGI disconnect message) and frees the KV blocks."""
    start = _kv_free(server)
    body = json.dumps({"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 400, "ignore_eos": True})
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 10
        while _kv_free(server) == start:
            assert time.monotonic() < deadline, "the request never took KV blocks"
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while _kv_free(server) != start:
        assert time.monotonic() < deadline, "KV blocks not released after the client left"
        time.sleep(0.05)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def chat_greedy(llm, messages, n: int, **template_variables) -> str:
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_variables)
    [expected] = llm.generate([ids if isinstance(ids, list) else ids["input_ids"]], greedy(n))
    return expected.text


def test_responses_plain_and_streamed_equal_one_rank(server, llm):
    client = server.openai_client("none")
    expected = chat_greedy(llm, [{"role": "user", "content": "hello"}], 10)
    plain = client.responses.create(model=MODEL, input="hello", max_output_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output_text == expected and plain.usage.output_tokens == 10
    with client.responses.stream(model=MODEL, input="hello", max_output_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected
    long_input = "Tell me about the weather in every city of the world, " * 8
    first, again = (client.responses.create(model=MODEL, input=long_input, max_output_tokens=4, temperature=0)
                    for _ in range(2))
    assert again.output_text == first.output_text   # the same prompt again: its prefix comes from the cache
    assert first.usage.input_tokens_details.cached_tokens == 0 < again.usage.input_tokens_details.cached_tokens


def test_responses_tools_and_previous_response_id(server):
    client = server.openai_client("none")
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=100, temperature=0)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:   # the grammar held the random model to the tool's schema
        arguments = json.loads(call.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls])
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens   # the whole conversation was prompted


def test_an_agents_sdk_loop_calls_two_tools_then_answers(server):
    """The OpenAI Agents SDK (Responses API) runs its tool loop: a random-weight model is steered turn by turn
    through tool_choice (first get_weather, then get_time, then none), the SDK runs each tool and sends its
    output back, and the loop ends in a structured answer. Lengths are bounded in the schemas so that the grammar
    ends every turn before max_tokens (the SDK treats a cut answer as a failure, as it should)."""
    agents.set_tracing_disabled(True)
    called: list[tuple[str, str]] = []
    City = Annotated[str, pydantic.Field(max_length=8)]

    @agents.function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return f"sunny in {city}"

    @agents.function_tool
    def get_time(city: City) -> str:
        """The local time in a city."""
        called.append(("get_time", city))
        return "12:00"

    class Answer(pydantic.BaseModel):
        summary: Annotated[str, pydantic.Field(max_length=8)]

    steps = iter(["get_time", "none"])

    class Steer(agents.AgentHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = agent.model_settings.resolve(agents.ModelSettings(tool_choice=next(steps)))

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="assistant", instructions="Answer with the tools.", model=model, output_type=Answer,
                         tools=[get_weather, get_time], reset_tool_choice=False, hooks=Steer(),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", parallel_tool_calls=False,
                                                             max_tokens=80, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather and time in Paris?", max_turns=5)
    assert [name for name, _ in called] == ["get_weather", "get_time"]
    assert isinstance(result.final_output, Answer)
    outputs = [item for item in result.to_input_list() if item.get("type") == "function_call_output"]
    assert [item["output"] for item in outputs] == [f"sunny in {called[0][1]}", "12:00"]


def test_the_anthropic_client_runs_the_messages_api(server):
    check_messages_api(server.base_url, MODEL, max_tokens=300)


def test_thinking_asked_for_comes_back_as_thinking_blocks(server):
    """The template opens the reasoning when asked to think, so the answer starts in it: a thinking block, streamed
    as thinking_delta, never text (the reasoning parser reads where the prompt left the block)."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    ask = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Think first."}],
               thinking={"type": "enabled", "budget_tokens": 1024})
    message = client.messages.create(**ask)
    assert [block.type for block in message.content] == ["thinking"] and message.content[0].thinking
    assert message.stop_reason == "max_tokens"
    kinds = [event.delta.type for event in client.messages.create(**ask, stream=True)
             if event.type == "content_block_delta"]
    assert "thinking_delta" in kinds and "text_delta" not in kinds
    responses = server.openai_client("none").responses.create(model=MODEL, input="Think first.", max_output_tokens=8,
                                                              reasoning={"effort": "high"},
                                                              extra_body={"chat_template_kwargs": {"thinking": True}})
    assert [item.type for item in responses.output] == ["reasoning"] and responses.output_text == ""
