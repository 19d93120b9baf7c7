"""One request must never kill a worker: parameter bounds, per-request failure, and a fuzz over every parameter.

- bounds: `SamplingParams.validate` refuses what the engine cannot do (naming the parameter), and the
  extremes it accepts (top_k beyond the vocabulary, a temperature of 1e-40, the largest seed, n seeds
  wrapping past it) generate normally;
- isolation: a request whose sampling or detokenizing raises finishes alone with finish_reason
  "error" (KV blocks freed); through the server its client gets a 500 or an SSE error event while
  other clients and /health are unaffected;
- fuzz: random in-schema values of every sampling parameter through the server's schema and a
  2-rank expert-parallel engine, which must stay healthy and answer a normal request after each.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from engine_helpers import PROMPTS, greedy
from server_harness import serve_in_process
from moe_runtime import LLM, SamplingParams
from moe_runtime.front.async_engine import RequestFailedError
from moe_runtime.errors import InvalidRequestError
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator
from moe_runtime.server.errors import APIError
from moe_runtime.server.protocol import CompletionRequest
from moe_runtime.server.request_conversion import choice_specs
from moe_runtime.server.structured_output_request import requested_structure

pytestmark = pytest.mark.timeout(120)

POISON = [9, 8, 7, 6]          # the prompt whose requests the injected failures hit
TOP_SEED = 2**63 - 1


# ---- bounds --------------------------------------------------------------------------------

ADMISSION = RequestLimits(vocab_size=2000, max_model_len=10**6, kv_capacity_tokens=10**6)
REFUSED = [
    (dict(seed=2**63), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-1), "seed"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-1e-40), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=2, min_tokens=3), "min_tokens"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(stop=["x" * 1025]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(1025))), "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs, param", REFUSED, ids=[f"{p}={str(k[p])[:12]}" for k, p in REFUSED])
def test_sampling_params_refuse_what_the_engine_cannot_do(kwargs, param):
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.{param}="):
        ADMISSION.check([1, 2], SamplingParams(**kwargs))   # at admission: construction checks nothing


def admitted(params: SamplingParams) -> SamplingParams:
    ADMISSION.check([1, 2], params)
    return params


def test_extremes_the_engine_can_do_are_accepted_with_their_meaning():
    assert admitted(SamplingParams(seed=TOP_SEED)).seed == TOP_SEED
    assert admitted(SamplingParams(top_k=2**63)).top_k == SamplingParams.MAX_TOP_K  # beyond any vocabulary: all
    assert admitted(SamplingParams(temperature=1e-40)).greedy                       # below the floor: greedy
    assert not admitted(SamplingParams(temperature=SamplingParams.MIN_TEMPERATURE)).greedy
    assert admitted(SamplingParams(stop=["x" * 1024] * 16,
                                   stop_token_ids=list(range(1024)))).stop_token_ids[-1] == 1023


def test_request_limits_refuse_stop_token_ids_and_logprobs_beyond_the_vocabulary():
    limits = RequestLimits(vocab_size=10, max_model_len=100, kv_capacity_tokens=1000)
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.stop_token_ids="):
        limits.check([1, 2], SamplingParams(stop_token_ids=[3, 10]))
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.logprobs="):
        limits.check([1, 2], SamplingParams(logprobs=11))
    params = SamplingParams()
    params.seed = 2**64  # changed after construction: admission checks what it is given
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.seed="):
        limits.check([1, 2], params)


def test_n_choice_seeds_wrap_below_the_limit():
    request = CompletionRequest(prompt=[1], n=3, seed=TOP_SEED)
    assert [spec.params.seed for spec in choice_specs(request, [[1]], 4, None)] == [TOP_SEED, 0, 1]
    with pytest.raises(ValidationError, match="seed"):
        CompletionRequest(prompt=[1], n=3, seed=2**63)


# ---- one engine in process ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), device="cpu", kv_cache_memory=8 * 2**20, max_num_seqs=8) as engine:
        yield engine


@dataclass
class PoisonedSampler:
    """The engine's sampler, except that a batch holding a request on the POISON prompt raises."""

    inner: Sampler

    def __call__(self, logits, seqs):
        if any(seq.prompt_token_ids == POISON for seq in seqs):
            raise RuntimeError("injected sampling failure")
        return self.inner(logits, seqs)


def assert_engine_idle(engine) -> None:
    assert not engine.has_unfinished() and not engine.outputs.requests
    blocks = engine.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks, "KV blocks leaked"


def test_extreme_but_valid_values_generate(llm):
    prompt = PROMPTS[0]
    [all_tokens] = llm.generate([prompt], SamplingParams(max_tokens=6, top_k=2**63, seed=5, ignore_eos=True))
    [no_top_k] = llm.generate([prompt], SamplingParams(max_tokens=6, top_k=-1, seed=5, ignore_eos=True))
    assert all_tokens.token_ids == no_top_k.token_ids
    [cold] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1e-40, seed=1, ignore_eos=True))
    assert cold.token_ids == llm.generate([prompt], greedy(6))[0].token_ids
    [top_seed] = llm.generate([prompt], SamplingParams(max_tokens=6, seed=TOP_SEED, ignore_eos=True))
    assert top_seed.finish_reason == "length" and len(top_seed.token_ids) == 6
    assert_engine_idle(llm.engine)


def test_a_request_whose_sampling_raises_fails_alone(llm, monkeypatch):
    params = [greedy(8), SamplingParams(max_tokens=8, seed=3, ignore_eos=True), greedy(8)]
    solo = llm.generate(PROMPTS[:3], params)
    monkeypatch.setattr(llm.core, "sampler", PoisonedSampler(llm.core.sampler))
    outputs = llm.generate([PROMPTS[0], POISON, PROMPTS[1], PROMPTS[2]], [params[0], greedy(8), *params[1:]])
    failed = outputs[1]
    assert failed.finished and failed.finish_reason == "error" and "injected sampling failure" in failed.error
    assert [o.token_ids for o in outputs[:1] + outputs[2:]] == [o.token_ids for o in solo]  # seeded one included
    assert all(o.error is None and o.finish_reason == "length" for o in outputs[:1] + outputs[2:])
    assert_engine_idle(llm.engine)


def test_a_request_with_non_finite_probabilities_fails_alone(llm, monkeypatch):
    runner = llm.core.runner
    real_execute = runner._execute   # the forward under execute and execute_and_sample, whichever the step calls

    def nan_for_poison(seqs, graph_sampling):
        step = real_execute(seqs, graph_sampling)
        assert step.draw is None   # this engine samples on the host: the poisoned logits reach its sampler
        logits = step.logits.clone()                                        # [B, V]
        for row, seq in enumerate(seqs):
            if seq.prompt_token_ids == POISON:
                logits[row] = math.nan
        return dataclasses.replace(step, logits=logits)

    monkeypatch.setattr(runner, "_execute", nan_for_poison)
    sampled = SamplingParams(max_tokens=4, seed=1, ignore_eos=True)
    healthy, poisoned = llm.generate([PROMPTS[0], POISON], [sampled, sampled])
    assert poisoned.finish_reason == "error" and "not finite" in poisoned.error
    assert healthy.finish_reason == "length" and len(healthy.token_ids) == 4
    assert_engine_idle(llm.engine)


def test_a_request_whose_detokenizing_raises_fails_alone(llm, monkeypatch):
    """The front detokenizes: a failure there fails that request and aborts it on the core."""
    engine = llm.engine
    engine.add_request("fine", PROMPTS[0], greedy(5))
    engine.add_request("poisoned", POISON, greedy(5))
    poisoned_state = engine.outputs.requests["poisoned"].decode_state
    real_increment = engine.outputs.detokenizer.increment

    def increment(token_ids, state):
        if state is poisoned_state and len(token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_increment(token_ids, state)

    monkeypatch.setattr(engine.outputs.detokenizer, "increment", increment)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["poisoned"].finish_reason == "error" and "UnicodeDecodeError" in finals["poisoned"].error
    assert finals["fine"].finish_reason == "length" and finals["fine"].token_ids == \
        llm.generate([PROMPTS[0]], greedy(5))[0].token_ids
    assert_engine_idle(engine)


# ---- the async engine and the server, in process -------------------------------------------

def test_async_engine_fails_only_the_request_the_engine_failed(llm, monkeypatch):
    monkeypatch.setattr(llm.core, "sampler", PoisonedSampler(llm.core.sampler))

    async def scenario(_, async_engine):
        async def collect(request_id, prompt):
            return [o async for o in async_engine.generate(request_id, prompt, greedy(4))]

        results = await asyncio.gather(collect("a", PROMPTS[0]), collect("b", POISON), return_exceptions=True)
        return results, async_engine.front.health()

    (fine, failed), health = serve_in_process(llm.engine, scenario, timeout_s=90)
    assert isinstance(failed, RequestFailedError) and "injected sampling failure" in str(failed)
    assert fine[-1].finish_reason == "length" and health.healthy


def test_server_fails_only_the_client_whose_request_failed(llm, monkeypatch):
    monkeypatch.setattr(llm.core, "sampler", PoisonedSampler(llm.core.sampler))
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def scenario(client, _):
        plain_fail, plain_ok, streamed_fail = await asyncio.gather(
            client.post("/v1/completions", json={"prompt": POISON, **body}),
            client.post("/v1/completions", json={"prompt": PROMPTS[0], **body}),
            client.post("/v1/completions", json={"prompt": POISON, "stream": True, **body}),
        )
        n_fail = await client.post("/v1/completions", json={"prompt": POISON, "n": 2, "seed": 1, **body})
        health = await client.get("/health")
        after = await client.post("/v1/completions", json={"prompt": PROMPTS[0], **body})
        return plain_fail, plain_ok, streamed_fail, n_fail, health, after

    plain_fail, plain_ok, streamed_fail, n_fail, health, after = serve_in_process(llm.engine, scenario, timeout_s=90)
    for failed in (plain_fail, n_fail):  # what the message says is the HTTP layer's choice (moe_runtime/server/errors.py)
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["type"] == "internal_server_error"
    assert streamed_fail.status_code == 200
    events = [line[len("data: "):] for line in streamed_fail.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["type"] == "internal_server_error"
    assert health.status_code == 200
    expected = llm.generate([PROMPTS[0]], greedy(4))[0].text
    assert plain_ok.status_code == after.status_code == 200
    assert plain_ok.json()["choices"][0]["text"] == after.json()["choices"][0]["text"] == expected
    assert_engine_idle(llm.engine)


SERVER_REFUSALS = [
    ({"seed": 2**63}, "seed"),
    ({"seed": -1}, "seed"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),   # outside the vocabulary: the engine's check
    ({"max_tokens": 2**64}, "max_tokens"),
]


def test_server_refuses_out_of_bounds_values_naming_the_parameter_and_accepts_extremes(llm):
    async def scenario(client, _):
        refusals = [await client.post("/v1/completions", json={"prompt": PROMPTS[0], **body})
                    for body, _ in SERVER_REFUSALS]
        nan_top_p = await client.post("/v1/completions", content=b'{"prompt": [1, 2], "top_p": NaN}',
                                      headers={"Content-Type": "application/json"})
        accepted = [await client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, **body})
                    for body in ({"top_k": 2**63}, {"temperature": 1e-40}, {"n": 3, "seed": TOP_SEED},
                                 {"top_p": 5e-324, "seed": 0})]
        return refusals, nan_top_p, accepted, await client.get("/health")

    refusals, nan_top_p, accepted, health = serve_in_process(llm.engine, scenario, timeout_s=90)
    for response, (_, param) in zip(refusals + [nan_top_p], SERVER_REFUSALS + [({}, "top_p")]):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    for response in accepted:
        assert response.status_code == 200, response.text
        assert all(c["finish_reason"] in ("stop", "length") for c in response.json()["choices"])
    assert len(accepted[2].json()["choices"]) == 3
    assert health.status_code == 200
    assert_engine_idle(llm.engine)


# ---- fuzz: every parameter through the schema and a 2-rank engine --------------------------

FUZZ_SEED = 20240611
FUZZ_REQUESTS = 60
INTS = [0, 1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -1]
FLOATS = [-0.0, 5e-324, 1e-40, 1e-5, 2.0, 1e308, math.inf, -math.inf, math.nan, -1.0]
EDGES = [  # valid extremes, mixed into many fuzzed bodies (each crashed a worker once)
    {"top_k": 2**63, "temperature": 1.0},
    {"temperature": 1e-40},
    {"temperature": 1e-5, "top_k": 0},
    {"n": 3, "seed": TOP_SEED, "temperature": 1.0},
    {"top_p": 5e-324, "temperature": 1.0},
]


def random_body(rng: random.Random) -> dict:
    """A /v1/completions body: each sampling field absent, or set to an ordinary value, or (three times in
    ten) to an extreme one: a bound, one past it, a huge integer, a denormal, inf or NaN (JSON as Python
    parses it allows those)."""
    def pick(ordinary: list, extreme: list):
        if rng.random() < 0.7:
            return rng.choice(ordinary)
        return rng.choice(extreme) if rng.random() < 0.7 else rng.choice(INTS + FLOATS)

    fields = {
        "max_tokens": lambda: pick([1, 2, 3, 4], [0, 600, 2**63]),
        "temperature": lambda: pick([0.0, 0.7, 1.0], [1e-40, 5e-324, 1e-5, 1e308, math.nan]),
        "top_p": lambda: pick([0.1, 0.9, 1.0], [5e-324, math.nan]),
        "top_k": lambda: pick([0, 1, 5, 50], [2**63, 2**64, 512]),
        "seed": lambda: pick([0, 7, 12345], [TOP_SEED, TOP_SEED - 1, 2**63]),
        "n": lambda: pick([1, 2, 3], [0, 65]),
        "min_tokens": lambda: pick([0, 1], [4, 2**63]),
        "logprobs": lambda: pick([0, 1, 5], [20, 21, 2**63]),
        "stop": lambda: pick(["e", ["a", "the"]], [[""], ["x" * 1024] * 16, ["x" * 1025], ["ab"] * 17]),
        "stop_token_ids": lambda: [pick([1, 2, 100], [511, 512, 2**63 - 1]) for _ in range(rng.randint(0, 3))],
        "ignore_eos": lambda: rng.random() < 0.5,
    }
    controls = {  # the logits processors: one of them per body, at most
        "presence_penalty": lambda: pick([0.0, 0.5, -1.0], [2.0, -2.0, 2.01, math.nan]),
        "frequency_penalty": lambda: pick([0.0, 1.0, -0.5], [2.0, -2.0, -2.01, math.inf]),
        "repetition_penalty": lambda: pick([1.0, 1.3, 0.8], [0.01, 100.0, 0.0, 1e-9, 101.0]),
        "min_p": lambda: pick([0.0, 0.1, 0.5], [1.0, 5e-324, 1.01]),
        "guided_regex": lambda: pick([r"[a-z]{1,4}", r"\d+", "(yes|no)!"], ["(a", "", "[z-a]", "a" * 70000]),
        "logit_bias": lambda: {str(pick([1, 2, 100], [511, 512, 2**63 - 1])): pick([-100, 5.0, 100], [100.5, math.nan])
                               for _ in range(rng.randint(0, 3))},
    }
    body: dict = {"prompt": rng.choice(PROMPTS), "max_tokens": fields.pop("max_tokens")()}  # not the default 16
    for name, value in fields.items():
        if rng.random() < 0.5:
            body[name] = value()
    if rng.random() < 0.6:
        name = rng.choice(sorted(controls))
        body[name] = controls[name]()
    if body.get("n", 1) in (2, 3) and rng.random() < 0.7:
        body["seed"] = rng.choice([TOP_SEED, TOP_SEED - 1])  # the n choices' seeds wrap past 2**63
    if rng.random() < 0.4:
        body.update(rng.choice(EDGES))
    return body


def direct_params(body: dict) -> dict:
    """The body's sampling fields as `SamplingParams` keywords (the offline API, no pydantic in front)."""
    keep = ("temperature", "top_p", "top_k", "seed", "min_tokens", "logprobs", "stop", "stop_token_ids",
            "ignore_eos", "max_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    params = {name: body[name] for name in keep if name in body}
    if "guided_regex" in body:
        params["structured_output"] = StructuredOutputSpec(regex=body["guided_regex"])
    if "logit_bias" in body:
        params["logit_bias"] = {int(token) if token.lstrip("-").isdigit() else token: bias   # a bad key stays bad
                                for token, bias in body["logit_bias"].items()}
    return params


def engine_work(body: dict, rng: random.Random, engine) -> tuple[list[list[int]], list[SamplingParams]] | None:
    """The prompts and params a request becomes, or None where the schema or the engine refuses it."""
    try:
        if rng.random() < 0.7:  # through the server's schema and its n-choice seeds
            request = CompletionRequest.model_validate(body)
            structure = requested_structure(request, StructuredOutputValidator())
            specs = choice_specs(request, [list(request.prompt)], request.max_tokens, request.logprobs,
                                 structured_output=structure)
            work = [spec.prompt_token_ids for spec in specs], [spec.params for spec in specs]
        else:
            work = [body["prompt"]], [SamplingParams(**direct_params(body))]
        for prompt, params in zip(*work):
            engine.limits.check(prompt, params)
    except (ValidationError, APIError, InvalidRequestError):
        return None
    return work


def test_fuzzed_requests_never_hurt_a_two_rank_engine(checkpoint):
    rng = random.Random(FUZZ_SEED)
    with LLM(str(checkpoint), device="cpu", ep=2, max_num_seqs=8) as llm:
        normal = llm.generate([PROMPTS[2]], greedy(2))[0].token_ids
        ran = 0
        for i in range(FUZZ_REQUESTS):
            body = random_body(rng)
            work = engine_work(body, rng, llm.engine)
            if work is not None:
                ran += 1
                for output, params in zip(llm.generate(*work), work[1]):
                    assert output.finish_reason in ("stop", "length"), (body, output)
                    assert 1 <= len(output.token_ids) <= params.max_tokens
            assert llm.engine.health().healthy, f"request {i} {body} hurt the engine: {llm.engine.health()}"
            assert llm.generate([PROMPTS[2]], greedy(2))[0].token_ids == normal, f"after request {i} {body}"
        assert ran >= FUZZ_REQUESTS // 6, f"only {ran} of {FUZZ_REQUESTS} fuzzed requests were valid"


def test_a_stop_string_ends_the_request_on_the_core_with_reason_stop(llm, monkeypatch):
    """The front sees the stop string; the core is told to end the request with that reason."""
    [free_run] = llm.generate([PROMPTS[0]], greedy(12))
    stop = free_run.text[len(free_run.text) // 2:][:2] or free_run.text
    ended = []
    real_drop = llm.core.drop_request
    monkeypatch.setattr(llm.core, "drop_request", lambda request_id, reason="abort": (
        ended.append(reason), real_drop(request_id, reason))[1])
    [stopped] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         stop=[stop]))
    assert stopped.finish_reason == "stop" and ended == ["stop"]
    assert_engine_idle(llm.engine)
