"""Routes beyond completions and chat, and the streaming options, against the real `moe-serve` (one server for
the module, tiny MoE checkpoint, API key set): GET /v1/models/{id}, vLLM's /tokenize and /detokenize,
GET /version, HEAD /health, `stream_options` (refused without `stream`, `continuous_usage_stats`), and
`logprobs: 0` on completions."""
import httpx
import openai
import pytest
from server_harness import ServerProcess
from transformers import AutoTokenizer

import moe_runtime

pytestmark = pytest.mark.timeout(180)

API_KEY = "routes-key"
MODEL = "org/tiny-moe"          # a served name with a slash, as hub ids have
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--served-model-name", MODEL,
                             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "16M", "--api-key", API_KEY,
                             "--log-level", "warning"])
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(API_KEY)


@pytest.fixture(scope="module")
def http(server):
    with server.http_client(API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


# ---- models, version, health ---------------------------------------------------------------------------

def test_retrieve_the_served_model_and_404_for_others(client, http):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "moe-runtime")
    assert model.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    error = assert_error(http.get("/v1/models/org/other"), 404, "model", "model_not_found")
    assert error["type"] == "invalid_request_error" and "org/other" in error["message"]


def test_version_and_head_health(server, http):
    assert http.get("/version").json() == {"version": moe_runtime.__version__}
    head = httpx.head(server.base_url + "/health")            # open: no key
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("method,path", [("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                                         ("GET", f"/v1/models/{MODEL}")])
def test_new_routes_need_the_api_key(server, method, path):
    response = httpx.request(method, server.base_url + path, json={"prompt": "x"})
    assert_error(response, 401, None, "invalid_api_key")


# ---- /tokenize and /detokenize ---------------------------------------------------------------------------

def test_tokenize_a_prompt(http, tokenizer):
    text = "Hello wörld, tokenize me"
    plain = http.post("/tokenize", json={"prompt": text, "model": MODEL}).json()
    assert plain == {"count": len(tokenizer.encode(text)), "max_model_len": MAX_MODEL_LEN,
                     "tokens": tokenizer.encode(text), "token_strs": None}
    assert plain["tokens"][0] == tokenizer.bos_token_id                      # special tokens added by default
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == plain["tokens"][1:]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_messages_counts_what_chat_completions_sends(http, client, tokenizer):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count me."}]
    counted = http.post("/tokenize", json={"messages": messages}).json()
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
    assert counted["tokens"] == expected and counted["count"] == len(expected)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == counted["count"]
    without_header = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert tokenizer.decode(without_header["tokens"]).endswith("Count me.<|im_end|>\n")


def test_detokenize_round_trip(http, tokenizer):
    ids = tokenizer.encode("round trip ✓", add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids, "model": MODEL}).json() == {"prompt": "round trip ✓"}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens"),                   # the vocabulary is [0, 512)
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**30]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * (2**17 + 1)}, 400, "tokens"),          # more than the bound
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
], ids=["id-past-vocabulary", "negative-id", "huge-id", "too-many-ids", "not-an-id", "no-tokens", "detokenize-model",
        "neither", "both", "tokenize-model", "both-generation-modes", "bad-role"])
def test_bad_tokenizer_requests_are_refused_naming_the_parameter(http, path, body, status, param):
    assert_error(http.post(path, json=body), status, param)


# ---- stream_options, continuous usage, logprobs 0 -------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_options_without_stream_is_a_400(client, endpoint):
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream_options={"include_usage": True})
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client, endpoint):
    def stream(options):
        if endpoint == "completions":
            return list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, stream=True,
                                                  stream_options=options, extra_body={"ignore_eos": True}))
        return list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=6, stream=True, stream_options=options,
                                                   extra_body={"ignore_eos": True}))

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    assert all(chunk.usage is not None for chunk in chunks)
    completion = [chunk.usage.completion_tokens for chunk in chunks]
    assert completion == sorted(completion) and completion[-1] == 6 and completion[0] < 6
    assert len({chunk.usage.prompt_tokens for chunk in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)

    final_only = stream({"include_usage": True})
    assert [chunk.usage is not None for chunk in final_only] == [False] * (len(final_only) - 1) + [True]
    assert all(chunk.usage is None for chunk in stream({"continuous_usage_stats": True}))   # as vLLM: with include_usage


def test_logprobs_zero_returns_the_chosen_tokens_logprob(client):
    def ask(logprobs):
        return client.completions.create(model=MODEL, prompt=[9, 99, 199], max_tokens=5, temperature=0,
                                         logprobs=logprobs, extra_body={"ignore_eos": True}).choices[0]

    zero, one = ask(0), ask(1)
    assert zero.text == one.text and len(zero.logprobs.token_logprobs) == 5
    assert zero.logprobs.token_logprobs == pytest.approx(one.logprobs.token_logprobs, abs=1e-5)
    assert all(lp <= 0 for lp in zero.logprobs.token_logprobs)
    for token, chosen, top in zip(zero.logprobs.tokens, zero.logprobs.token_logprobs, zero.logprobs.top_logprobs):
        assert top == pytest.approx({token: chosen})   # only the sampled token, as OpenAI answers logprobs 0
