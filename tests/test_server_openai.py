"""The real `moe-serve` on a tiny MoE checkpoint, driven with the official `openai` client and raw HTTP.

One server for the module (`--max-num-seqs 4 --max-queue 8 --api-key`); greedy answers are held
against the offline `LLM` API on the same checkpoint.
"""
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from server_harness import ServerProcess
from tiny_checkpoints import HFOracle

from moe_runtime import LLM, SamplingParams
from moe_runtime.server.metrics import parse_samples

pytestmark = pytest.mark.timeout(180)

API_KEY = "test-key"
MODEL = "tiny-moe"
MAX_NUM_SEQS = 4
MAX_QUEUE = 8
KV_MEMORY = "16M"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--served-model-name", MODEL,
                             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE),
                             "--kv-cache-memory", KV_MEMORY, "--api-key", API_KEY, "--log-level", "warning"])
    process.start()
    yield process
    code = process.stop()
    assert code == 0, f"moe-serve did not shut down cleanly on SIGTERM (exit {code}):\n{process.tail()}"


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), device="cpu", kv_cache_memory=16 * 2**20, max_num_seqs=MAX_NUM_SEQS) as offline:
        yield offline


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(API_KEY)


@pytest.fixture(scope="module")
def http(server):
    with server.http_client(API_KEY) as c:
        yield c


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def metrics(http) -> dict[str, float]:
    return parse_samples(http.get("/metrics").text)


FREE = 'moe_kv_blocks_free{dp_rank="0"}'
RUNNING = 'moe_num_requests_running{dp_rank="0"}'


def wait_for_idle_kv(http, free_blocks: float, timeout_s: float = 20.0) -> dict[str, float]:
    """Metrics once nothing runs and `free_blocks` KV blocks are free again (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metrics(http)
        if samples[RUNNING] == 0 and samples[FREE] == free_blocks:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not released: {samples[FREE]} free, {free_blocks} at the start, "
                                 f"{samples[RUNNING]} running")
        time.sleep(0.05)


# ---- happy paths ---------------------------------------------------------------------------

def test_models_lists_the_served_model(client, llm):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == llm.engine.max_model_len


@pytest.mark.parametrize("prompt", ["The quick brown fox", [5, 17, 42, 99, 3, 250]])
def test_completion_greedy_equals_the_llm_api(client, llm, prompt):
    expected = llm.generate(prompt, greedy(12))[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_greedy_equals_the_llm_api_on_the_chat_template(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    expected = llm.generate([prompt_ids], greedy(10))[0]

    response = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(prompt_ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.total_tokens == len(prompt_ids) + 10


def test_concurrent_streaming_clients_each_get_their_greedy_answer(server, llm):
    prompts = [[7, 8, 9], list(range(30, 70)), [400, 12, 12, 12], [77], list(range(100, 112)), [5, 6]]
    expected = [o.text for o in llm.generate(prompts, greedy(16))]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        own = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        stream = own.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(prompts))] == expected


def test_n_seeded_choices_are_distinct_and_reproducible(client):
    def ask():
        response = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, n=3, seed=11,
                                             temperature=1.0, extra_body={"ignore_eos": True})
        return [(c.index, c.text) for c in sorted(response.choices, key=lambda c: c.index)]

    first, second = ask(), ask()
    assert first == second
    assert [i for i, _ in first] == [0, 1, 2]
    assert len({text for _, text in first}) > 1


def test_logprobs_in_both_shapes(client, llm):
    response = client.completions.create(model=MODEL, prompt=[5, 17, 42], max_tokens=5, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    assert "".join(lp.tokens) == response.choices[0].text

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)


def test_stop_string_cuts_the_answer_streamed_or_not(client, llm):
    prompt = [9, 99, 199, 299]
    full = llm.generate([prompt], greedy(24))[0].text
    candidates = [full[k:k + 2] for k in range(2, len(full) - 2)
                  if full[k:k + 2].isprintable() and full[k:k + 2].isascii() and full[k:k + 2].strip()]
    assert candidates, f"no usable stop string in {full!r}"
    stop = candidates[0]
    expected = full[: full.find(stop)]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == expected


# ---- echo and prompt logprobs (what lm-evaluation-harness's local-completions sends) ----------

@pytest.fixture(scope="module")
def oracle(checkpoint):
    return HFOracle(checkpoint)


def transformers_prompt_logprobs(oracle, prompt_ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """transformers' logprob of each prompt token after the first, and the whole log-softmax [P-1, V]."""
    logp = oracle.prefill_logits(prompt_ids)[:-1].log_softmax(dim=-1)
    return logp.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist(), logp


def test_echo_scores_token_prompts_as_lm_eval_asks(client, llm, oracle):
    prompts = [[5, 17, 42, 99, 3, 250], list(range(30, 70))]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(map(len, prompts))
    choices = sorted(response.choices, key=lambda c: c.index)
    for choice, prompt in zip(choices, prompts, strict=True):
        assert choice.finish_reason == "length"
        assert choice.text == llm.tokenizer.decode(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected, logp = transformers_prompt_logprobs(oracle, prompt)
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        # lm-eval's is_greedy: the token against the best alternative (the token itself is among them too)
        assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
        best = [max(top.values()) for top in lp.top_logprobs[1:]]
        assert best == pytest.approx(logp.max(dim=-1).values.tolist(), abs=1e-4)


def test_echo_leads_whole_and_streamed_answers_with_the_prompt(client, llm, oracle):
    prompts = ["The quick brown fox", "Hello"]
    expected = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2))
    ask = dict(model=MODEL, prompt=prompts, max_tokens=3, echo=True, logprobs=2, temperature=0,
               extra_body={"ignore_eos": True})
    whole = sorted(client.completions.create(**ask).choices, key=lambda c: c.index)
    streamed_text, streamed_logprobs = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed_text[choice.index] += choice.text
            streamed_logprobs[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    for choice, prompt, output in zip(whole, prompts, expected, strict=True):
        assert choice.text == prompt + output.text == streamed_text[choice.index]
        prompt_ids = output.prompt_token_ids
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt_ids) + 3
        assert lp.token_logprobs[0] is None and streamed_logprobs[choice.index][0] is None
        assert lp.token_logprobs[1:] == pytest.approx(streamed_logprobs[choice.index][1:], abs=1e-4)
        expected_prompt, _ = transformers_prompt_logprobs(oracle, prompt_ids)
        assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected_prompt, abs=1e-4)
        assert lp.token_logprobs[len(prompt_ids):] == pytest.approx([e.logprob for e in output.logprobs], abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset[len(prompt_ids)] == len(prompt)


def test_logprobs_zero_gives_each_tokens_own_logprob_without_alternatives(client):
    response = client.completions.create(model=MODEL, prompt=[5, 17, 42], max_tokens=2, echo=True, logprobs=0,
                                         temperature=0, extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.top_logprobs[1:] == [{token: logprob} for token, logprob in zip(lp.tokens[1:], lp.token_logprobs[1:])]
    assert len(lp.tokens) == 5 and all(v <= 0 for v in lp.token_logprobs[1:])


def test_vllm_prompt_logprobs_extension(client, oracle):
    prompt = [5, 17, 42, 99, 3, 250]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    choice = response.choices[0]
    assert response.usage.completion_tokens == 1 and choice.logprobs is None
    positions = choice.prompt_logprobs
    assert len(positions) == len(prompt) and positions[0] is None
    expected, logp = transformers_prompt_logprobs(oracle, prompt)
    for token_id, want, row, position in zip(prompt[1:], expected, logp, positions[1:], strict=True):
        own = position[str(token_id)]
        assert own["logprob"] == pytest.approx(want, abs=1e-4)
        assert int((row > want + 1e-4).sum()) < own["rank"] <= int((row > want - 1e-4).sum()) + 1
        ranked = sorted((entry["rank"], entry["logprob"]) for entry in position.values())
        assert [r for r, _ in ranked if r <= 2] == [1, 2]
        assert [v for r, v in ranked if r <= 2] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


# ---- sampling controls ----------------------------------------------------------------------

CONTROLS = [  # (body fields, the same as SamplingParams keywords)
    ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, dict(presence_penalty=1.5, frequency_penalty=0.5)),
    ({"repetition_penalty": 1.5}, dict(repetition_penalty=1.5)),
    ({"logit_bias": {"42": 6.0, "7": -100}}, dict(logit_bias={42: 6.0, 7: -100})),
    ({"min_p": 0.2, "temperature": 1.0, "seed": 5}, dict(min_p=0.2, temperature=1.0, seed=5)),
    ({"min_tokens": 4, "stop_token_ids": [42], "logit_bias": {"42": 100}},
     dict(min_tokens=4, stop_token_ids=[42], logit_bias={42: 100})),
]


@pytest.mark.parametrize("fields, params", CONTROLS,
                         ids=["presence+frequency", "repetition", "logit_bias", "min_p", "min_tokens+stop_token_ids"])
def test_sampling_controls_through_the_server_equal_the_llm_api(client, llm, fields, params):
    prompt = [9, 99, 199, 299]
    offline = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], SamplingParams(**{**offline, **params}))[0]
    body = {"temperature": 0, "ignore_eos": True, **fields}
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body=body)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason

    messages = [{"role": "user", "content": "Name a prime."}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_expected = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)],
                                 SamplingParams(**{**offline, **params}))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, extra_body=body)
    assert chat.choices[0].message.content == chat_expected.text


def test_choice_i_of_n_is_the_request_with_seed_plus_i(client):
    """The documented derivation: with `seed` and `n`, choice i samples with seed + i (wrapped below 2**63)."""
    ask = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    together = sorted(client.completions.create(n=3, seed=100, **ask).choices, key=lambda c: c.index)
    alone = [client.completions.create(n=1, seed=100 + i, **ask).choices[0].text for i in range(3)]
    assert [c.text for c in together] == alone


# ---- refusals ------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),     # outside the vocabulary: the engine's check
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": list(range(1, 600))}, 400, "prompt"),
    ({"prompt": [1, 2, 3], "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": [1, 100000]}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS, ids=[p for _, _, p in BAD_COMPLETIONS])
def test_bad_completion_requests_are_refused_naming_the_parameter(http, body, status, param):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi" * 400}]}, "messages"),
])
def test_bad_chat_requests_are_refused_naming_the_parameter(http, body, param):
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_json_is_a_400_and_the_server_keeps_serving(http, client):
    response = http.post("/v1/completions", content=b'{"prompt": "x", ', headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices[0].text is not None


def test_api_key_is_required_on_v1_only(server):
    no_key = httpx.get(server.base_url + "/v1/models")
    wrong = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer nope"})
    assert no_key.status_code == 401 and wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_expert_load_without_a_recorder_is_a_404_error_body(http):
    response = http.get("/v1/expert_load")
    assert response.status_code == 404 and response.json()["error"]["code"] == "no_expert_load"


# ---- disconnects, queue, metrics -----------------------------------------------------------

def test_client_disconnect_mid_stream_aborts_and_frees_kv_blocks(http):
    start = wait_for_idle_kv(http, metrics(http)[FREE])
    free_at_start = start[FREE]
    aborted_before = start.get('moe_requests_total{status="aborted"}', 0)
    body = {"prompt": list(range(10, 60)), "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # keep the iterator: dropping it mid-stream closes the connection
        chunks = 0
        while chunks < 3:
            line = next(lines)
            chunks += line.startswith("data: ") and "choices" in line
        during = metrics(http)
        assert during[FREE] < free_at_start  # the request holds blocks while the client is still there
        assert during[RUNNING] == 1
    # leaving the block closes the connection mid-stream
    after = wait_for_idle_kv(http, free_at_start)
    assert after['moe_requests_total{status="aborted"}'] == aborted_before + 1
    assert after['moe_request_finish_total{reason="abort"}'] >= 1
    assert after["moe_generation_tokens_total"] - start["moe_generation_tokens_total"] < 400


def test_queue_full_is_429_with_retry_after(server, http):
    free_at_start = metrics(http)[FREE]
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True, "ignore_eos": True}

    async def one(client: httpx.AsyncClient):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
            return response.status_code, response.headers.get("retry-after"), response.content if \
                response.status_code != 200 else b""
        # leaving the block closes the connection: the accepted streams are aborted

    async def burst():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(20)))

    results = asyncio.run(burst())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(accepted) + len(refused) == 20
    assert len(accepted) >= MAX_QUEUE and refused, [r[0] for r in results]
    assert all(retry == "1" for _, retry, _ in refused)
    assert json.loads(refused[0][2])["error"]["code"] == "queue_full"
    samples = wait_for_idle_kv(http, free_at_start)
    assert samples['moe_requests_total{status="rejected"}'] == len(refused)


def test_metrics_report_requests_tokens_and_latency(http, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, extra_body={"ignore_eos": True})
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    samples = metrics(http)
    assert samples['moe_requests_total{status="success"}'] >= 1
    assert samples['moe_requests_total{status="bad_request"}'] >= 1
    assert samples["moe_time_to_first_token_seconds_count"] >= 1
    assert samples["moe_inter_token_latency_seconds_count"] >= 3
    assert samples["moe_generation_tokens_total"] >= 4 and samples["moe_prompt_tokens_total"] >= 1
    assert samples["moe_engine_healthy"] == 1
    assert 0 <= samples['moe_kv_cache_usage_ratio{dp_rank="0"}'] <= 1
