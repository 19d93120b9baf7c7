"""Structured output through xgrammar: specs, compilation cache, bitmasks, the engine, and the served API.

- pieces: spec shapes, the front's validator (a bad schema/regex/grammar names its field), the
  compile cache (once per spec, bounded), the tokenizer view (special tokens never allowed), the
  batched bitmask (constrained rows only), JSON strings without raw control characters;
- engine (tiny checkpoint, in process): a complete grammar ends the request with "stop" even with
  ignore_eos, max_tokens cuts it with "length", free rows of a batch are untouched, a grammar that
  fails on the core fails its request alone;
- server (the random-weight demo model, one `moe-serve` for the module, the official `openai`
  client): 20 requests streamed and 20 not, chat and completions, each output valid for the schema
  (`jsonschema`); json_object, vLLM's guided_* and structured_outputs; refusals name the field.
"""
from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from server_harness import ServerProcess
from transformers import AutoTokenizer

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.errors import InvalidRequestError
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.sampling.structured_output.compiler import GrammarCompilerCache
from moe_runtime.sampling.structured_output.grammar_bitmask import GrammarBitmask
from moe_runtime.sampling.structured_output.grammar_state import GrammarState
from moe_runtime.sampling.structured_output.spec import StructuredOutputSpec
from moe_runtime.sampling.structured_output.validator import StructuredOutputValidator

pytestmark = pytest.mark.timeout(300)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PERSON_SPEC = StructuredOutputSpec(json_schema=json.dumps(PERSON))
YES_NO = StructuredOutputSpec(grammar='root ::= "yes" | "no"')


# ---- pieces ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one"),
    (dict(regex="a", grammar="root ::= \"a\""), "exactly one"),
    (dict(json_schema={"type": "object"}), r"json_schema: must be a string"),
    (dict(regex="a" * (StructuredOutputSpec.MAX_CHARS + 1)), "at most"),
    (dict(regex="  "), "regex: is empty"),
    (dict(json_object="yes"), "json_object"),
])
def test_spec_shapes_are_checked_naming_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.structured_output.*{message}"):
        StructuredOutputSpec(**kwargs)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputSpec(json_schema='{"type": '), "json_schema"),
    (StructuredOutputSpec(json_schema='[1, 2]'), "json_schema"),
    (StructuredOutputSpec(json_schema='{"type": "nonsense"}'), "json_schema"),
    (StructuredOutputSpec(regex="(a"), "regex"),
    (StructuredOutputSpec(regex="(?=a)b"), "regex"),
    (StructuredOutputSpec(grammar="root ::= undefined_rule"), "grammar"),
    (StructuredOutputSpec(grammar='start ::= "a"'), "grammar"),
])
def test_the_validator_refuses_what_xgrammar_cannot_read_naming_the_field(spec, field):
    validator = StructuredOutputValidator()
    for _ in range(2):  # the second answer comes from the cache, and is the same refusal
        with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.structured_output\.{field}: "):
            validator.check(spec)
    assert len(validator) == 1


def test_the_validator_accepts_each_kind_and_caches_the_verdict():
    validator = StructuredOutputValidator(max_entries=2)
    for spec in (PERSON_SPEC, StructuredOutputSpec(json_object=True), StructuredOutputSpec(regex=r"\d+"), YES_NO):
        validator.check(spec)
    assert len(validator) == 2  # bounded


def test_the_limits_refuse_structured_output_without_a_tokenizer_or_with_a_bad_spec():
    params = SamplingParams(structured_output=YES_NO)
    RequestLimits(vocab_size=600, max_model_len=100, kv_capacity_tokens=1000).check([1], params)
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.structured_output: needs a tokenizer"):
        RequestLimits(vocab_size=600, max_model_len=100, kv_capacity_tokens=1000, has_tokenizer=False).check(
            [1], params)
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.structured_output\.regex: "):
        RequestLimits(vocab_size=600, max_model_len=100, kv_capacity_tokens=1000).check(
            [1], SamplingParams(structured_output=StructuredOutputSpec(regex="[z-a]")))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return GrammarCompilerCache.for_tokenizer(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])


def allowed_after(compiler: GrammarCompilerCache, spec: StructuredOutputSpec, text: str) -> set[int]:
    """The token ids the grammar allows once `text` has been accepted."""
    state = GrammarState.start(compiler.compile(spec))
    assert state.matcher.accept_string(text)
    logits = torch.zeros(1, compiler.vocab_size)
    GrammarBitmask().apply(logits, [0], [state])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_special_tokens_are_never_allowed_and_stop_tokens_only_at_the_end(compiler, tiny_tokenizer):
    specials = set(tiny_tokenizer.all_special_ids)
    eos = tiny_tokenizer.eos_token_id
    inside_a_string = allowed_after(compiler, StructuredOutputSpec(json_object=True), '{"')
    assert len(inside_a_string) > 100 and not inside_a_string & specials
    assert allowed_after(compiler, YES_NO, "yes") == {eos}


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 5}, {"type": "string"}],
                         ids=["length-bounded", "unbounded"])
def test_json_strings_hold_neither_raw_control_characters_nor_encoded_surrogates(compiler, schema):
    """Both would make the output invalid JSON (json.loads refuses them); xgrammar's own classes allow them."""
    spec = StructuredOutputSpec(json_schema=json.dumps(schema))
    accepts = lambda text: (lambda state: state.matcher.accept_string(text) and state.matcher.is_completed())(
        GrammarState.start(compiler.compile(spec)))
    assert accepts('"a b"') and accepts('"é日"')
    assert not accepts('"a\tb"') and not accepts('"\x03"')
    assert not accepts(b'"\xed\xa5\xa2"')        # U+D962 "encoded" as UTF-8 (the demo model produced it)


def test_each_spec_is_compiled_once_and_the_cache_is_bounded(compiler):
    cache = GrammarCompilerCache(compiler.tokenizer_info, max_entries=2)
    first = cache.compile(YES_NO)
    assert cache.compile(StructuredOutputSpec(grammar='root ::= "yes" | "no"')) is first   # equal spec: cached
    cache.compile(PERSON_SPEC)
    cache.compile(StructuredOutputSpec(regex=r"\d+"))                                    # evicts YES_NO
    assert cache.compilations == 3 and len(cache) == 2
    cache.compile(YES_NO)
    assert cache.compilations == 4


def test_a_spec_that_cannot_compile_gives_a_failed_state_not_an_exception(compiler):
    state = compiler.new_state(StructuredOutputSpec(regex="(a"))
    assert state.matcher is None and "regex" in state.error
    assert state.accept(5) == state.error


def test_the_bitmask_masks_the_constrained_rows_only(compiler):
    torch.manual_seed(0)
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    state = GrammarState.start(compiler.compile(YES_NO))
    GrammarBitmask().apply(logits, [1], [state])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert 0 < int(allowed.sum()) < 10 and torch.equal(logits[1][allowed], before[1][allowed])


# ---- in the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    with LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", max_num_seqs=8) as engine:
        yield engine


def test_a_complete_grammar_ends_the_request_with_stop_even_with_ignore_eos(llm):
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                                                    structured_output=YES_NO))
    for out in outs:
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        assert out.token_ids[-1] in llm.core.eos_ids    # the grammar's end: its stop token


def test_regex_outputs_match_on_the_tiny_model(llm):
    regex = r"[a-z]{2,5}-\d{3}"
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                 structured_output=StructuredOutputSpec(regex=regex))
                                  for i in range(len(PROMPTS))])
    assert all(re.fullmatch(regex, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    [cut] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0, structured_output=PERSON_SPEC))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_free_rows_of_a_batch_are_untouched_and_each_spec_compiles_once(llm):
    alone = [o.token_ids for o in llm.generate([PROMPTS[0], PROMPTS[2]], greedy(10))]
    spec = StructuredOutputSpec(regex=r"(ab|cd){3,6}")
    compiled_before = llm.core.grammars.compilations
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
                         [greedy(10), greedy(30, structured_output=spec), greedy(10),
                          SamplingParams(max_tokens=30, seed=1, structured_output=spec)])
    assert [batch[0].token_ids, batch[2].token_ids] == alone
    assert re.fullmatch(r"(ab|cd){3,6}", batch[1].text) and re.fullmatch(r"(ab|cd){3,6}", batch[3].text)
    assert llm.core.grammars.compilations == compiled_before + 1


def test_a_grammar_that_fails_on_the_core_fails_its_request_alone(llm, monkeypatch):
    def broken(spec):
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(llm.core.grammars, "compile", broken)
    fine, failed = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(6), greedy(6, structured_output=YES_NO)])
    assert failed.finish_reason == "error" and "injected compile failure" in failed.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == 6
    blocks = llm.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputSpec(regex="(a"), "regex"),
    (StructuredOutputSpec(json_schema='{"type": "nonsense"}'), "json_schema"),
    (StructuredOutputSpec(grammar="root ::= x"), "grammar"),
])
def test_bad_specs_are_refused_at_admission_naming_the_field(llm, spec, field):
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.structured_output\.{field}: "):
        llm.generate([PROMPTS[0]], greedy(4, structured_output=spec))
    assert not llm.engine.has_unfinished()


# ---- the served API, on the random-weight demo model ---------------------------------------------

MODEL = "demo"
REQUESTS = 20
MAX_TOKENS = 400   # PERSON with at most 16 whitespace characters per gap fits well below this


@pytest.fixture(scope="module")
def server(demo_model):
    process = ServerProcess(["--model", str(demo_model), "--device", "cpu", "--served-model-name", MODEL,
                             "--max-num-seqs", "16", "--log-level", "warning"])
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def ask_person(client: openai.OpenAI, i: int, stream: bool) -> tuple[str, str]:
    """Request i: chat for even i, completions for odd i; returns (text, finish_reason)."""
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=1.0, seed=i, stream=stream)
    if i % 2 == 0:
        response = client.chat.completions.create(messages=[{"role": "user", "content": f"Person {i}, as JSON"}],
                                                  response_format=JSON_SCHEMA_FORMAT, **common)
        if not stream:
            return response.choices[0].message.content, response.choices[0].finish_reason
        chunks = [c for c in response if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    response = client.completions.create(prompt=f"Person {i}:", extra_body={"response_format": JSON_SCHEMA_FORMAT},
                                         **common)
    if not stream:
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [c for c in response if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_even_the_random_demo_model_answers_json_that_validates(client, stream):
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda i: ask_person(client, i, stream), range(REQUESTS)))
    for text, finish_reason in answers:
        assert finish_reason == "stop", (finish_reason, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in answers}) > REQUESTS // 2     # seeded sampling: varied answers


def test_json_object_mode_and_a_cut_by_max_tokens(client):
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                           response_format={"type": "json_object"}, max_tokens=120,
                                           temperature=0.0)
    choice = whole.choices[0]
    if choice.finish_reason == "stop":       # an unbounded object may also run to max_tokens on random weights
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                         response_format=JSON_SCHEMA_FORMAT, max_tokens=4, temperature=0.0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda text: re.fullmatch(r"[a-z]{3}-\d{2}", text)),
    ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda text: text in ("yes!", "no!")),
    ({"guided_choice": ["alpha", "beta \"quoted\"", "γ"]}, lambda text: text in ("alpha", "beta \"quoted\"", "γ")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    # bounded repetitions: the grammar itself ends the answer (an unbounded one may run to max_tokens on
    # random weights, depending only on the seeds' draws)
    ({"guided_grammar": 'root ::= "(" [0-9]{1,3} ("," [0-9]{1,3}){0,3} ")"'},
     lambda text: re.fullmatch(r"\(\d{1,3}(,\d{1,3}){0,3}\)", text)),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
     lambda text: isinstance(json.loads(text), list) and all(isinstance(v, bool) for v in json.loads(text))),
    ({"structured_outputs": {"json": json.dumps({"type": "integer", "minimum": 5, "maximum": 9})}},
     lambda text: 5 <= json.loads(text) <= 9),
], ids=["guided_regex", "structured_outputs.regex", "guided_choice", "structured_outputs.choice",
        "guided_grammar", "guided_json", "structured_outputs.json"])
def test_vllm_style_fields_constrain_completions(client, extra, check):
    for seed in (1, 2):
        response = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=120, temperature=1.0,
                                             seed=seed, extra_body=extra)
        text = response.choices[0].text
        assert response.choices[0].finish_reason == "stop" and check(text), text


STRUCTURED_REFUSALS = [
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize("extra, param", STRUCTURED_REFUSALS, ids=[p for _, p in STRUCTURED_REFUSALS])
def test_unusable_structured_output_is_a_400_naming_the_field(http, extra, param):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = http.post(path, json={**body, "max_tokens": 4, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and param.split(".")[0] in error["message"], error


def test_the_openai_client_sees_a_bad_schema_as_a_bad_request(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format=bad, max_tokens=4)
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=2).usage.completion_tokens == 2


def test_the_server_parses_a_spec_into_the_engines_own_cache_off_the_loop():
    """Admission checks specs on the event loop; the server parses them first, in its conversion thread, into the
    engine's own cache, so the loop only looks the verdict up (the fake engine never checks specs itself)."""
    from server_harness import FakeEngine, serve_in_process

    engine = FakeEngine()

    async def scenario(client, async_engine):
        reply = await client.post("/v1/completions", json={
            "prompt": [1, 2, 3], "max_tokens": 2, "response_format": {"type": "json_object"}})
        assert reply.status_code == 200, reply.text

    serve_in_process(engine, scenario)
    assert len(engine.limits.structured_output) == 1, "the server parsed the spec into a cache of its own"
