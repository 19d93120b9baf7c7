"""Request bounds are stated once (`moe_runtime.sampling.bounds.BOUNDS`) and a request is validated once.

- every edge of every bound in the table: the HTTP schema (`server.protocol`) and the engine's admission
  check (`RequestLimits.check`) take and refuse the same values, the ones the table says (the cases are
  made from the table: a new bound is tested here without a new test);
- `SamplingParams.validate` runs exactly once per request: through `LLM.generate` (one rank), and on the
  multi-rank front's path (admission, the seed it fills in, the AddRequest's msgpack round trip: a rank
  decoding it does not validate again); the server's conversion does not validate at all;
- the context-length rule is one function, the server's refusal and the engine's agree at its edge.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
from pydantic import ValidationError

from moe_runtime.attention_dp.messages import AddRequest, MessageCodec
from engine_helpers import PROMPTS
from moe_runtime import LLM
from moe_runtime.engine.request_limits import ContextLengthError, RequestLimits, check_context_length
from moe_runtime.errors import InvalidRequestError
from moe_runtime.sampling.bounds import BOUNDS, MAX_INT, Bound
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.errors import APIError
from moe_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from moe_runtime.server.request_conversion import ModelInfo, check_context, choice_specs

pytestmark = pytest.mark.timeout(120)

# big enough that only the bound under test can refuse: every int64 token id is in the vocabulary, and
# prompt + max_tokens fits however large max_tokens is
LIMITS = RequestLimits(vocab_size=MAX_INT + 1, max_model_len=2**64, kv_capacity_tokens=2**64, has_tokenizer=True)
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


# ---- (a) one table, both layers -------------------------------------------------------------

def edge_values(bound: Bound) -> list:
    """Each edge of the bound, one step inside and one step outside it; for numbers also NaN and infinities,
    for integers a fraction."""
    def step(value, direction):
        return value + direction if bound.integer else math.nextafter(value, direction * math.inf)

    values = []
    for edge, is_open in ((bound.lo, bound.lo_open), (bound.hi, bound.hi_open)):
        if edge is not None:
            values += [edge, step(edge, -1), step(edge, +1)]
    if bound.part in ("value", "item", "key", "bias"):
        values += [math.nan, math.inf, -math.inf] if not bound.integer else [(bound.lo or 0) + 0.5]
    return values


def table_verdict(bound: Bound, value) -> bool:
    if bound.capped and bound.integer and isinstance(value, int) and value > bound.hi:
        return True  # the same meaning as hi (top_k: every token)
    return bound.admits(value)


# How a value of a non-"value" bound becomes a request field: (HTTP body value, engine value).
FORMS = {
    ("stop", "count"): lambda n: (["x"] * n, ["x"] * n),
    ("stop", "chars"): lambda n: (["x" * n], ["x" * n]),
    ("stop_token_ids", "count"): lambda n: ([1] * n, [1] * n),
    ("stop_token_ids", "item"): lambda t: ([t], [t]),
    ("logit_bias", "count"): lambda n: ({str(i): 1.0 for i in range(n)}, {i: 1.0 for i in range(n)}),
    ("logit_bias", "key"): lambda t: ({str(t): 1.0}, {t: 1.0}),
    ("logit_bias", "bias"): lambda b: ({"1": b}, {1: b}),
}


def forms(bound: Bound, value) -> tuple[object, object]:
    if bound.part == "value":
        return value, value
    return FORMS[bound.field, bound.part](value)


def http_accepts(body: dict, model=CompletionRequest) -> bool:
    """The schema takes it, and the server makes engine parameters of it."""
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        assert all(error["loc"][0] in body for error in exc.errors()), exc   # the error names the field
        return False
    if isinstance(request, CompletionRequest):
        choice_specs(request, [[1]], request.max_tokens, request.logprobs, request.prompt_logprobs)
    return True


def engine_accepts(field: str, value) -> bool:
    base = {"max_tokens": MAX_INT, "prompt_logprobs": 0}   # lets max_tokens be 0 and min_tokens be MAX_INT
    try:
        LIMITS.check([1], SamplingParams(**{**base, field: value}))
    except InvalidRequestError as exc:
        assert str(exc).startswith(f"SamplingParams.{field}="), exc   # the refusal names the field
        return False
    return True


CASES = [(bound, value) for bound in BOUNDS for value in edge_values(bound)]


def test_every_bound_of_the_table_has_a_request_form():
    assert {(b.field, b.part) for b in BOUNDS if b.part != "value"} <= set(FORMS)
    assert {b.field for b in BOUNDS} <= set(CompletionRequest.model_fields)
    assert {b.field for b in BOUNDS if b.engine} <= {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("bound, value", CASES, ids=[f"{b.key}={v!r}"[:60] for b, v in CASES])
def test_the_schema_and_the_engine_take_and_refuse_the_same_values(bound, value):
    body_value, engine_value = forms(bound, value)
    expected = table_verdict(bound, value)
    assert http_accepts({"prompt": [1], bound.field: body_value}) == expected
    if bound.engine:
        assert engine_accepts(bound.field, engine_value) == expected
    chat_field = {"logprobs": "top_logprobs", "max_tokens": None, "prompt_logprobs": None}.get(bound.field,
                                                                                            bound.field)
    if chat_field is not None:   # chat shares the fields (its top_logprobs are the engine's logprobs)
        body = {"messages": CHAT_MESSAGES, chat_field: body_value, "logprobs": chat_field == "top_logprobs"}
        assert http_accepts(body, ChatCompletionRequest) == expected


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_takes_the_tables_max_tokens_from_one(field):
    """A chat answer has a token at least (completions may score the prompt only: max_tokens 0)."""
    verdicts = {v: http_accepts({"messages": CHAT_MESSAGES, field: v}, ChatCompletionRequest)
                for v in (0, 1, MAX_INT, MAX_INT + 1)}
    assert verdicts == {0: False, 1: True, MAX_INT: True, MAX_INT + 1: False}


def test_temperature_is_openais_range_everywhere():
    assert http_accepts({"prompt": [1], "temperature": 2.0}) and engine_accepts("temperature", 2.0)
    assert not http_accepts({"prompt": [1], "temperature": 3.0}) and not engine_accepts("temperature", 3.0)


# ---- (b) validated once per request ---------------------------------------------------------

@pytest.fixture
def validations(monkeypatch) -> list[SamplingParams]:
    """Every `SamplingParams.validate` call from now on (the params it was called on)."""
    calls = []
    real = SamplingParams.validate

    def spy(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(SamplingParams, "validate", spy)
    return calls


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", kv_cache_memory=8 * 2**20,
             max_num_seqs=8) as engine:
        yield engine


def test_one_validation_per_request_through_llm(llm, validations):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, stop=["never"], seed=1)
    assert validations == []   # construction checks nothing
    [output] = llm.generate([PROMPTS[0]], params)
    assert len(output.token_ids) == 3
    assert validations == [params]
    llm.generate(PROMPTS[:3], params)
    assert len(validations) == 1 + 3   # one per request


def test_a_bad_offline_value_is_refused_at_admission_naming_the_field(llm, validations):
    params = SamplingParams(temperature=3.0)   # constructing it is fine; LLM.generate refuses it
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.temperature=3\.0: must be a number in \[0, 2\]"):
        llm.generate([PROMPTS[0]], params)
    assert len(validations) == 1 and not llm.engine.has_unfinished()


def test_one_validation_per_request_on_the_multi_rank_front_path(validations):
    """What `Front.add_request` does for ranks: admit, fill in a seed, send an AddRequest; each
    rank decodes it (msgspec runs `__post_init__`) and trusts it."""
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=2**40, stop="x", logit_bias={3: 1.5})
    LIMITS.check([1, 2], params)
    params = dataclasses.replace(params, seed=12345)
    codec = MessageCodec()
    payload = codec.encode(AddRequest(request_id="r", prompt_token_ids=[1, 2], params=params, dp_rank=0))
    on_ranks = [codec.decode_to_rank(payload) for _ in range(4)]
    assert len(validations) == 1
    assert all(message.params == params for message in on_ranks)
    assert params.top_k == SamplingParams.MAX_TOP_K and params.stop == ["x"]   # normalized once, at construction


def test_the_servers_conversion_does_not_validate(validations):
    request = CompletionRequest(prompt=[1], n=3, seed=5, stop="x", logit_bias={"7": -2.0}, max_tokens=4)
    specs = choice_specs(request, [[1], [2]], 4, None)
    assert len(specs) == 6 and validations == []
    for spec in specs:
        LIMITS.check(spec.prompt_token_ids, spec.params)   # what submitting each choice does
    assert len(validations) == 6
    assert specs[1].params.logit_bias == {7: -2.0} and specs[1].params.stop == ["x"]


# ---- the context length: one rule ------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, max_tokens", [(90, 10), (90, 11), (100, 0), (100, 1), (101, 0), (1, 100)])
def test_the_server_refuses_the_context_exactly_where_admission_does(prompt_len, max_tokens):
    model = ModelInfo("m", max_model_len=100, tokenizer=None)
    limits = RequestLimits(vocab_size=10, max_model_len=100, kv_capacity_tokens=10**6)
    engine_refuses = server_refuses = False
    try:
        limits.check([1] * prompt_len, SamplingParams(max_tokens=max_tokens, prompt_logprobs=0))
    except ContextLengthError as exc:
        engine_refuses = exc.field
    try:
        check_context(prompt_len, max_tokens, model, "messages", "max_completion_tokens")
    except APIError as exc:
        assert exc.code == "context_length_exceeded" and exc.param in exc.message
        server_refuses = {"messages": "prompt", "max_completion_tokens": "max_tokens"}[exc.param]
    assert engine_refuses == server_refuses
    assert bool(engine_refuses) == (prompt_len + max_tokens > 100)
    with pytest.raises(ContextLengthError) if engine_refuses else contextlib.nullcontext():
        check_context_length(prompt_len, max_tokens, 100)
