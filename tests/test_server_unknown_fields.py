"""Unknown request fields are ignored with one warning per name; known-but-unimplemented ones only at no-op values."""
import asyncio
import logging

import httpx
import pytest
from server_harness import FakeEngine

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app

pytestmark = pytest.mark.timeout(60)

WARNING_LOGGER = "moe_runtime.server.unknown_fields"


class RecordingChatTokenizer:
    """One token per character; its "chat template" keeps the messages it was given, to check what reached it."""

    chat_template = "fake"

    def __init__(self):
        self.rendered: list[list[dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        self.rendered.append(messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 500 for c in text]


def post_all(requests: list[tuple[str, dict]], tokenizer=None) -> list[httpx.Response]:
    """Posts each (path, body) in turn to one app over a fake engine."""

    async def main():
        engine = FakeEngine()
        engine.tokenizer = tokenizer
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        app = build_app(async_engine, "fake")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=20) as client:
                return [await client.post(path, json=body) for path, body in requests]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 30))


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WARNING_LOGGER and r.levelno == logging.WARNING]


def test_the_vllm_bench_serve_completion_body_passes():
    body = {"model": "fake", "prompt": [1, 2, 3], "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    [response] = post_all([("/v1/completions", body)])
    assert response.status_code == 200, response.text
    assert response.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1.0}, {"min_p": 0.0}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"chat_template_kwargs": {"enable_thinking": False}}, {"metadata": {"run": "7"}}, {"store": False},
    {"reasoning_effort": "low"}, {"service_tier": "auto"},
], ids=lambda extra: next(iter(extra)))
def test_each_field_other_clients_send_passes_on_both_endpoints(extra):
    completion = {"prompt": [1, 2], "max_tokens": 2, **extra}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    responses = post_all([("/v1/completions", completion), ("/v1/chat/completions", chat)],
                         RecordingChatTokenizer())
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]


def test_an_unknown_field_is_warned_about_once_per_server_naming_it_and_the_endpoint(caplog):
    caplog.set_level(logging.WARNING, logger=WARNING_LOGGER)
    body = {"prompt": [1, 2], "max_tokens": 2, "store": True, "stream": True, "stream_options": {"shiny": 1}}
    chat = {"messages": [{"role": "user", "content": "hi", "audio": None}], "max_tokens": 2, "store": True}
    first, second, third = post_all([("/v1/completions", body), ("/v1/completions", body),
                                     ("/v1/chat/completions", chat)], RecordingChatTokenizer())
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    warnings = warnings_in(caplog)
    assert len(warnings) == 3, warnings   # store, stream_options.shiny, messages[].audio: each once
    assert any("/v1/completions" in w and "'store'" in w for w in warnings)
    assert any("/v1/completions" in w and "'stream_options.shiny'" in w for w in warnings)
    assert any("/v1/chat/completions" in w and "'messages[].audio'" in w for w in warnings)


def test_known_fields_are_not_warned_about(caplog):
    caplog.set_level(logging.WARNING, logger=WARNING_LOGGER)
    [response] = post_all([("/v1/completions", {"prompt": [1], "max_tokens": 2, "repetition_penalty": 1.0,
                                                "min_p": 0.0, "top_k": 5})])
    assert response.status_code == 200 and warnings_in(caplog) == []


HONOURED = [
    ("repetition_penalty", 1.3), ("min_p", 0.05), ("presence_penalty", 0.5), ("frequency_penalty", -1.0),
    ("logit_bias", {"3": -100}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"},
                                                                "strict": True, "description": "a number"}}),
    ("guided_json", {"type": "integer"}), ("guided_regex", "[a-z]+"), ("guided_choice", ["a", "b"]),
    ("guided_grammar", 'root ::= "a"'), ("structured_outputs", {"json": {"type": "integer"}}),
]


@pytest.mark.parametrize("field,value", HONOURED, ids=[field for field, _ in HONOURED])
def test_sampling_controls_and_structured_output_fields_are_known_on_both_endpoints(caplog, field, value):
    caplog.set_level(logging.WARNING, logger=WARNING_LOGGER)
    completion = {"prompt": [1], "max_tokens": 2, field: value}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    responses = post_all([("/v1/completions", completion), ("/v1/chat/completions", chat)], RecordingChatTokenizer())
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert warnings_in(caplog) == []


def test_replayed_chat_history_with_tool_calls_reaches_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "weather",
         "content": [{"type": "text", "text": "rain"}]},
    ]
    tokenizer = RecordingChatTokenizer()
    [response] = post_all([("/v1/chat/completions", {"messages": messages, "max_tokens": 2})], tokenizer)
    assert response.status_code == 200, response.text
    _, assistant, tool = tokenizer.rendered[0]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool == {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "weather"}
