"""A whole P/D set through HTTP: `moe-serve --pd 1:1` starts a prefill instance, a decode
instance and the router; the official `openai` client talks to the router.

- completions and chat, streamed and not, equal a single in-process instance's greedy answers;
  requests the split does not fit (several choices, max_tokens 1) run whole on a decode instance;
- each instance's /metrics has the KV transfer bytes, transfer-time histogram and p50/p99, and
  queue times by role; the router's counts how it served requests;
- a client leaving mid-stream frees the KV blocks on both sides;
- a decode instance killed mid-stream ends that stream with a clean error event, and the set stops
  (exit code 1, a line naming the instance) instead of limping on with a role missing.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest
from process_tree import alive
from server_harness import ServerProcess

from moe_runtime import LLM, SamplingParams
from moe_runtime.server.metrics import parse_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "tiny-pd"
KEY = "pd-key"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3_moe")


@pytest.fixture(scope="module")
def pd_set(checkpoint):
    process = ServerProcess(["--pd", "1:1", "--model", str(checkpoint), "--device", "cpu", "--served-model-name",
                             MODEL, "--kv-cache-memory", "4M", "--kv-transfer-timeout", "5", "--api-key", KEY,
                             "--log-level", "warning"], startup_timeout_s=240)
    process.start()
    yield process
    if process.process.poll() is None:   # else a test stopped the set (and checked its exit code)
        assert process.stop() == 0, process.tail()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), device="cpu") as offline:
        yield offline


def instance(pd_set, role: str) -> tuple[int, str]:
    """(pid, url) of the set's `role` instance, as the launcher announced it."""
    for line in pd_set.log:
        match = re.match(rf"moe-serve: {role}0 instance \(pid (\d+)\) on (\S+)", line)
        if match:
            return int(match.group(1)), match.group(2)
    raise AssertionError(f"the launcher did not announce its {role} instance:\n{pd_set.tail()}")


def metrics(url: str) -> dict[str, float]:
    return parse_samples(httpx.get(url + "/metrics", timeout=30).text)


def free_blocks(url: str) -> float:
    return metrics(url)['moe_kv_blocks_free{dp_rank="0"}']


def wait_for(check, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout_s}s")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_openai_client_through_the_router_gets_one_instance_s_answers(pd_set, llm):
    client = pd_set.openai_client(KEY)
    prompt = "def fibonacci(n):"
    [expected] = llm.generate([prompt], greedy(12))
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert plain.choices[0].text == expected.text and plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
    [scored] = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2))
    with_logprobs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, **GREEDY)
    assert with_logprobs.choices[0].logprobs.token_logprobs == pytest.approx(   # the first from the prefill
        [entry.logprob for entry in scored.logprobs], abs=1e-4)
    messages = [{"role": "user", "content": "hello " * 30}]   # a prompt of several KV blocks
    chat_ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    [chat_expected] = llm.generate([chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]], greedy(10))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert chat.choices[0].message.content == chat_expected.text
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == chat_expected.text
    assert client.models.list().data[0].id == MODEL


def test_requests_the_split_does_not_fit_run_whole_on_a_decode_instance(pd_set, llm):
    client = pd_set.openai_client(KEY)
    [expected] = llm.generate(["hello"], greedy(5))
    two = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2, **GREEDY)
    assert [choice.text for choice in two.choices] == [expected.text] * 2
    one = client.completions.create(model=MODEL, prompt="hello", max_tokens=1, **GREEDY)
    assert one.usage.completion_tokens == 1
    assert metrics(pd_set.base_url)['moe_router_requests_total{outcome="decode_only"}'] >= 2


def test_transfers_and_queue_times_are_in_the_metrics(pd_set):
    client = pd_set.openai_client(KEY)
    client.completions.create(model=MODEL, prompt="count the bytes", max_tokens=4, **GREEDY)
    decode, prefill = metrics(instance(pd_set, "decode")[1]), metrics(instance(pd_set, "prefill")[1])
    assert decode["moe_kv_transfer_bytes_total"] > 0 and decode['moe_kv_transfers_total{outcome="ok"}'] >= 1
    assert decode["moe_kv_transfer_seconds_count"] >= 1
    assert 'moe_kv_transfer_seconds_quantile{quantile="0.99"}' in decode
    assert decode['moe_queue_seconds_count{role="decode"}'] >= 1
    assert prefill['moe_queue_seconds_count{role="prefill"}'] >= 1
    assert prefill['moe_kv_exports_total{event="parked"}'] >= 1
    router = metrics(pd_set.base_url)
    assert router['moe_router_requests_total{outcome="disaggregated"}'] >= 1
    assert router["moe_router_prefill_seconds_count"] >= 1


def test_a_client_that_leaves_mid_stream_frees_kv_blocks_on_both_sides(pd_set):
    urls = [instance(pd_set, "prefill")[1], instance(pd_set, "decode")[1]]
    before = [free_blocks(url) for url in urls]
    aborted = metrics(urls[1])['moe_request_finish_total{reason="abort"}']
    body = {"model": MODEL, "prompt": "tell me a very long story " * 4, "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", pd_set.base_url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data:")) >= 3
        assert free_blocks(urls[1]) < before[1]          # the decode instance holds the request's blocks now
    wait_for(lambda: [free_blocks(url) for url in urls] == before, what=f"free KV blocks back to {before}")
    assert metrics(urls[1])['moe_request_finish_total{reason="abort"}'] == aborted + 1   # cut short, not finished


def test_a_dead_instance_ends_its_streams_cleanly_and_stops_the_set(pd_set):
    """Last in the module: it ends the set. (A router whose prefill instance is gone serves requests whole on a
    decode instance: tests/test_pd_router.py.)"""
    client = pd_set.openai_client(KEY)
    pid, url = instance(pd_set, "decode")
    stream = client.completions.create(model=MODEL, prompt="a long answer please", max_tokens=400, n=2,
                                       stream=True, **GREEDY)   # n=2: whole on the decode instance
    next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="decode instance"):
        for _ in stream:
            pass
    assert pd_set.process.wait(30) == 1           # `moe-serve --pd` does not limp on with a role missing
    assert any(re.search(rf"the decode0 instance \(pid {pid}\) exited with code -9", line) for line in pd_set.log), \
        pd_set.tail()
    prefill_pid, _ = instance(pd_set, "prefill")
    wait_for(lambda: not alive(prefill_pid), what="the prefill instance stopped with the set")
