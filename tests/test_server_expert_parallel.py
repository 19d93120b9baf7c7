"""The real `moe-serve --ep 2 --dp-attn 2` on a tiny MoE checkpoint, driven with the openai client:
greedy answers equal the one-rank `LLM` API's, concurrent clients land on both DP workers, a
disconnected stream frees its KV blocks, and the expert load is served."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from server_harness import ServerProcess

from moe_runtime import LLM, SamplingParams
from moe_runtime.server.metrics import parse_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "tiny-ep"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "2", "--dp-attn", "2",
                             "--served-model-name", MODEL, "--kv-cache-memory", "16M", "--log-level", "warning"])
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
