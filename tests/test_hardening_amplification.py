"""Hardening, round 2: a small body cannot ask for unbounded work, and odd inputs are 400s naming their field.

- choices amplification: prompts x n, prompt tokens x n and logit_bias entries x choices are bounded by the
  table's `WORK_BOUNDS` and refused (400, `request_too_large`, naming the field) before any choice is built
  or reaches the engine; the choices of a request share one logit_bias mapping;
- response amplification: the logprob entries a response would carry (prompt_logprobs, an echo's logprobs,
  the generated tokens' logprobs: positions x (alternatives + 1) x choices) are bounded the same way;
- unhandled inputs: a logit_bias key of 5,000 digits, an integer literal of 5,000 digits, a body or a
  schema nested past the parser's recursion limit, tool-call arguments nested 5,000 deep, a forced tool
  call whose schema xgrammar cannot read: each a 400 naming the field (none a 500, none Python's own wording),
  on the server and on the P/D router.
"""
from __future__ import annotations

import json
import time

import pytest
from server_harness import FakeEngine, serve_in_process
from test_server_unknown_fields import RecordingChatTokenizer

from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.bounds import WORK_BOUND
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.errors import APIError
from moe_runtime.server.pd_router.forwarding import parse_body as router_parse_body
from moe_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from moe_runtime.server.request_conversion import ModelInfo, chat_choices, completion_choices

pytestmark = pytest.mark.timeout(120)

JSON = {"Content-Type": "application/json"}
PYTHON_WORDING = ("set_int_max_str_digits", "maximum recursion depth", "Exceeds the limit")
MAX_CHOICES = WORK_BOUND["choices"].hi
MAX_PROMPT_TOKENS = WORK_BOUND["prompt_tokens"].hi
MAX_LOGIT_BIAS = WORK_BOUND["logit_bias"].hi
MAX_LOGPROBS = WORK_BOUND["logprobs"].hi


class CountingEngine(FakeEngine):
    """Counts the requests that reach the engine."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.admitted = 0

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.admitted += 1
        super().add_request(request_id, prompt_token_ids, params)


def post(body: dict | str, path: str = "/v1/completions", engine: FakeEngine | None = None,
         max_queue: int | None = None) -> tuple[int, dict, float]:
    """(status, JSON answer, seconds) of one request to an in-process app over `engine`."""
    raw = body if isinstance(body, str) else json.dumps(body)

    async def scenario(client, _):
        start = time.perf_counter()
        response = await client.post(path, content=raw, headers=JSON)
        return response.status_code, response.json(), time.perf_counter() - start

    return serve_in_process(engine or FakeEngine(), scenario, max_queue=max_queue, raise_app_exceptions=False)


def refused(answer: dict, param: str, code: str | None = None) -> bool:
    error = answer.get("error") or {}
    return error.get("param") == param and (code is None or error.get("code") == code)


def no_python_wording(answer: dict) -> bool:
    return not any(words in json.dumps(answer) for words in PYTHON_WORDING)


def model_info(tokenizer=None, max_model_len: int = 10**7) -> ModelInfo:
    return ModelInfo("fake", max_model_len, tokenizer)


# ---- 1. choices amplification ------------------------------------------------------------------------------

def test_prompts_times_n_over_the_bound_is_refused_before_any_choice_reaches_the_engine():
    """The issue's shape (many prompts x n=64), with a queue that would have taken the first few."""
    engine = CountingEngine()
    status, answer, seconds = post({"prompt": [[7, 8, 9]] * 300, "n": 64, "max_tokens": 1}, engine=engine,
                                   max_queue=8)
    assert status == 400 and refused(answer, "n", "request_too_large"), answer
    assert "300 prompts x n=64" in answer["error"]["message"]
    assert engine.admitted == 0 and seconds < 5


@pytest.mark.parametrize("prompts, n, param, accepted", [
    (MAX_CHOICES // 64, 64, "n", True),
    (MAX_CHOICES // 64 + 1, 64, "n", False),
    (MAX_CHOICES, 1, "prompt", True),
    (MAX_CHOICES + 1, 1, "prompt", False),
])
def test_the_choices_bound_edges(prompts, n, param, accepted):
    request = CompletionRequest(prompt=[[5, 6]] * prompts, n=n, max_tokens=1)
    if accepted:
        assert len(completion_choices(request, model_info())) == prompts * n
    else:
        with pytest.raises(APIError) as refusal:
            completion_choices(request, model_info())
        assert refusal.value.status == 400 and refusal.value.param == param


def test_logit_bias_entries_times_choices_are_bounded():
    bias = {str(i): 1.0 for i in range(1024)}
    engine = CountingEngine()
    status, answer, _ = post({"prompt": [[5, 6]] * 2, "n": 64, "max_tokens": 1, "logit_bias": bias}, engine=engine)
    assert status == 400 and refused(answer, "logit_bias", "request_too_large"), answer
    assert engine.admitted == 0
    within = CompletionRequest(prompt=[5, 6], n=64, max_tokens=1, logit_bias=bias)   # 1,024 x 64: the edge
    assert 1024 * 64 == MAX_LOGIT_BIAS and len(completion_choices(within, model_info())) == 64


def test_the_choices_of_a_request_share_one_logit_bias_mapping():
    request = CompletionRequest(prompt=[[5, 6]] * 4, n=16, max_tokens=1, seed=3,
                                logit_bias={str(i): 1.0 for i in range(1024)})
    specs = completion_choices(request, model_info())
    assert len({id(spec.params.logit_bias) for spec in specs}) == 1
    assert len({id(spec.params) for spec in specs}) == len(specs)          # each its own params (and seed)
    assert [spec.params.seed for spec in specs[:3]] == [3, 4, 5]


def test_prompt_tokens_times_n_are_bounded():
    engine = CountingEngine()
    status, answer, _ = post({"prompt": [5] * 20_000, "n": 64, "max_tokens": 1}, engine=engine)
    assert status == 400 and refused(answer, "n", "request_too_large"), answer
    assert engine.admitted == 0
    edge = CompletionRequest(prompt=[5] * (MAX_PROMPT_TOKENS // 64), n=64, max_tokens=1)
    assert len(completion_choices(edge, model_info())) == 64
    over = CompletionRequest(prompt=[5] * (MAX_PROMPT_TOKENS // 64 + 1), n=64, max_tokens=1)
    with pytest.raises(APIError, match="prompt tokens"):
        completion_choices(over, model_info())


# ---- 3. response amplification -----------------------------------------------------------------------------

def test_the_issues_prompt_logprobs_request_is_refused_before_any_work():
    """prompt_logprobs=20 on a 2,000-token prompt with n=64: 2.7 million entries, a 180 MB response."""
    engine = CountingEngine()
    status, answer, seconds = post({"prompt": [5] * 2000, "n": 64, "max_tokens": 1, "prompt_logprobs": 20},
                                   engine=engine)
    assert status == 400 and refused(answer, "prompt_logprobs", "request_too_large"), answer
    assert "n=64" in answer["error"]["message"] and engine.admitted == 0 and seconds < 5


def logprob_request(**fields) -> CompletionRequest:
    return CompletionRequest(**{"max_tokens": 1, **fields})


@pytest.mark.parametrize("fields, param", [
    # each exactly at the bound: positions x (alternatives + 1) x choices == MAX_LOGPROBS
    (dict(prompt=[5] * (MAX_LOGPROBS // 2 // 2), n=2, prompt_logprobs=1), "prompt_logprobs"),
    (dict(prompt=[5] * (MAX_LOGPROBS // 4), max_tokens=0, echo=True, logprobs=3), "logprobs"),
    (dict(prompt=[5, 6], max_tokens=MAX_LOGPROBS // 8 // 2, n=2, logprobs=7), "logprobs"),
])
def test_the_logprobs_bound_edges(fields, param):
    assert completion_choices(logprob_request(**fields), model_info())
    one_more = dict(fields, n=fields.get("n", 1) + 1)
    with pytest.raises(APIError) as refusal:
        completion_choices(logprob_request(**one_more), model_info())
    assert refusal.value.param == param and refusal.value.code == "request_too_large"


def test_echo_and_prompt_logprobs_both_count():
    prompt = [5] * (MAX_LOGPROBS // 4 + 1)      # each view alone fits (x (1 + 1)), both do not
    assert completion_choices(logprob_request(prompt=prompt, prompt_logprobs=1), model_info())
    with pytest.raises(APIError, match="prompt_logprobs.*logprobs"):
        completion_choices(logprob_request(prompt=prompt, prompt_logprobs=1, echo=True, logprobs=1, max_tokens=0),
                           model_info())


def test_chat_logprobs_count_the_default_max_tokens():
    messages = [{"role": "user", "content": "hi"}]
    model = model_info(RecordingChatTokenizer(), max_model_len=131_072)
    request = ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=20)
    with pytest.raises(APIError) as refusal:
        chat_choices(request, model)
    assert refusal.value.param == "top_logprobs" and "by default the rest of the context" in refusal.value.message
    bounded = ChatCompletionRequest(messages=messages, logprobs=True, top_logprobs=20, max_tokens=1000, n=4)
    assert len(chat_choices(bounded, model).choices) == 4


# ---- 4. unhandled inputs -----------------------------------------------------------------------------------

def test_a_logit_bias_key_of_5000_digits_is_a_400_naming_logit_bias():
    status, answer, _ = post({"prompt": [5, 6], "max_tokens": 1, "logit_bias": {"1" * 5000: 1.0}})
    assert status == 400 and refused(answer, "logit_bias"), answer
    assert "token id" in answer["error"]["message"] and no_python_wording(answer)


def test_the_engine_refuses_an_integer_too_long_to_print_naming_the_field():
    with pytest.raises(InvalidRequestError, match="SamplingParams.logit_bias"):
        SamplingParams(logit_bias={10**5000: 1.0}).validate()


def test_an_integer_literal_of_5000_digits_is_a_400_naming_its_field():
    status, answer, _ = post('{"prompt": [5, 6], "max_tokens": ' + "1" * 5000 + "}")
    assert status == 400 and refused(answer, "max_tokens"), answer
    assert "5000 digits" in answer["error"]["message"] and no_python_wording(answer)


def nested_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


@pytest.mark.parametrize("field, body", [
    ("guided_json", '{"prompt": [5, 6], "max_tokens": 1, "guided_json": ' + nested_schema(1100) + "}"),
    ("response_format", '{"prompt": [5, 6], "max_tokens": 1, "response_format": {"type": "json_schema", '
                        '"json_schema": {"name": "x", "schema": ' + nested_schema(1100) + "}}}"),
    ("guided_json", json.dumps({"prompt": [5, 6], "max_tokens": 1, "guided_json": nested_schema(1000)})),
], ids=["object", "response_format", "text"])
def test_a_schema_nested_past_the_recursion_limit_is_a_400_naming_its_field(field, body):
    """Past Python's recursion limit the body parser names the field; where the limit is higher (torch's
    compiler raises it once imported in the process) the body parses and the schema-depth bound names the
    schema inside the field. Either is a 400 naming where the nesting is."""
    status, answer, seconds = post(body)
    param = (answer.get("error") or {}).get("param") or ""
    assert status == 400 and (param == field or param.startswith(field + ".")), answer
    assert no_python_wording(answer) and seconds < 5


def test_tool_call_arguments_nested_5000_deep_are_no_500():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    engine = FakeEngine()
    engine.tokenizer = RecordingChatTokenizer()
    status, answer, _ = post({"messages": messages, "max_tokens": 1}, "/v1/chat/completions", engine)
    assert status == 200, answer


def test_a_forced_tool_call_whose_schema_xgrammar_cannot_read_is_a_400_naming_tools():
    """Checked in the conversion (off the event loop), not first at admission, whose refusal names no field."""
    parameters = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    engine = FakeEngine()
    engine.tokenizer = RecordingChatTokenizer()
    status, answer, _ = post(body, "/v1/chat/completions", engine)
    assert status == 400 and refused(answer, "tools"), answer
    assert "SamplingParams" not in answer["error"]["message"]


@pytest.mark.parametrize("raw, field", [
    (b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", "prompt"),
    (b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", "seed"),
], ids=["nested", "long_integer"])
def test_the_router_names_the_field_of_a_body_its_parser_gives_up_on(raw, field):
    with pytest.raises(APIError) as refusal:
        router_parse_body(raw)
    assert refusal.value.status == 400 and refusal.value.param == field


def test_a_tool_schema_nested_300_deep_is_a_400_naming_the_tool_and_the_bound():
    """Red team round 3: the chat template's recursion answered with Python's 'maximum recursion depth exceeded'."""
    parameters = json.loads(nested_schema(300))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                      {"type": "function", "function": {"name": "deep", "parameters": parameters}}]}
    status, answer, seconds = post(body, path="/v1/chat/completions")
    assert status == 400 and refused(answer, "tools.1.function.parameters"), answer
    assert "at most 64" in answer["error"]["message"] and no_python_wording(answer) and seconds < 5
