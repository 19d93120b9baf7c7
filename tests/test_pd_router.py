"""The P/D router against scripted instances (small HTTP servers on loopback ports), no engine:

- a client's `kv_transfer_params` is refused (400 naming it) and reaches no instance: only the
  router's own prefill answer supplies one;
- the prefill half carries the client's max_tokens (the instance validates the whole request and
  decides up front whether there is anything to decode); a prefill answer without a handle (its
  first token ended the request) is the client's answer, JSON or streamed, and nothing runs on a
  decode instance;
- with its only prefill instance gone the router serves requests whole on a decode instance;
- the keyless /health answers only the status (instances and counters need the key) and a probe is
  not logged at INFO;
- a prefill instance asked for a handle with max_tokens < 2 (asked so, or a chat prompt that leaves
  one token of room) runs the request whole, and one with more runs a single token and exports it.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from server_harness import free_port

from moe_runtime.sampling.params import SamplingParams
from moe_runtime.server.generation import ChoiceSpec
from moe_runtime.server.kv_transfer_request import with_kv_transfer
from moe_runtime.server.pd_router.app import build_router_app
from moe_runtime.server.pd_router.backends import BackendPool
from moe_runtime.server.protocol import ChatCompletionRequest, CompletionRequest

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class ScriptedInstance:
    """A moe-serve stand-in: /health 200, and POSTs answered by `answer(path, body)`; records what it got."""

    def __init__(self, answer):
        self.received: list[tuple[str, dict]] = []
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/{route:path}")
        async def post(route: str, request: Request):
            body = await request.json()
            self.received.append(("/v1/" + route, body))
            return JSONResponse(answer("/v1/" + route, body))

        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ScriptedInstance":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the scripted instance did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def completion(text: str, finish_reason: str, handle: dict | None = None) -> dict:
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    return {**answer, "kv_transfer_params": handle} if handle is not None else answer


def router(prefill_urls: list[str], decode_urls: list[str]) -> TestClient:
    app = build_router_app(BackendPool.of(prefill_urls, decode_urls), api_key=KEY, probe_interval_s=0.2)
    return TestClient(app)


def test_a_client_s_kv_transfer_params_are_refused_and_reach_no_instance():
    with ScriptedInstance(lambda path, body: completion(" a", "length", {"h": 1})) as prefill, \
            ScriptedInstance(lambda path, body: completion(" a b", "length")) as decode, \
            router([prefill.url], [decode.url]) as client:
        for body in ({"model": "m", "prompt": "hi", "max_tokens": 4, "kv_transfer_params": {"nonce": "x"}},
                     {"model": "m", "prompt": "hi", "max_tokens": 4, "n": 2, "kv_transfer_params": None},
                     {"model": "m", "prompt": "hi", "max_tokens": 4, "kv_transfer_params": {"do_remote_decode": True}}):
            refused = client.post("/v1/completions", json=body, headers=AUTH)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
        assert prefill.received == [] and decode.received == []
        served = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}, headers=AUTH)
        assert served.status_code == 200
        [(_, to_decode)] = decode.received
        assert to_decode["kv_transfer_params"] == {"h": 1}     # the prefill's handle, and only that
        [(_, to_prefill)] = prefill.received
        assert to_prefill["max_tokens"] == 4 and to_prefill["kv_transfer_params"] == {"do_remote_decode": True}


def test_a_prefill_answer_without_a_handle_is_the_client_s_answer():
    with ScriptedInstance(lambda path, body: completion(" done", "stop")) as prefill, \
            ScriptedInstance(lambda path, body: completion(" again", "length")) as decode, \
            router([prefill.url], [decode.url]) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 8}
        whole = client.post("/v1/completions", json=body, headers=AUTH)
        assert whole.status_code == 200 and "kv_transfer_params" not in whole.json()
        assert whole.json()["choices"][0]["text"] == " done" and whole.json()["choices"][0]["finish_reason"] == "stop"
        streamed = client.post("/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}, headers=AUTH)
        events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " done"
        assert chunks[-1]["usage"]["completion_tokens"] == 1
        assert decode.received == []            # nothing ran twice
        assert len(prefill.received) == 2
        assert 'moe_router_requests_total{outcome="prefill_only"} 2.0' in client.get("/metrics").text


def test_with_its_prefill_instance_gone_the_router_serves_requests_whole_on_a_decode_instance():
    gone = f"http://127.0.0.1:{free_port()}"    # nothing listens there
    with ScriptedInstance(lambda path, body: completion(" whole", "length")) as decode, \
            router([gone], [decode.url]) as client:
        for _ in range(2):   # the first finds it unreachable, the second finds it marked so
            served = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4},
                                 headers=AUTH)
            assert served.status_code == 200 and served.json()["choices"][0]["text"] == " whole"
        assert [body.get("kv_transfer_params") for _, body in decode.received] == [None, None]
        assert 'moe_router_requests_total{outcome="prefill_fallback"} 2.0' in client.get("/metrics").text


def test_the_keyless_health_answers_only_the_status_and_probes_are_not_logged_at_info(caplog):
    gone = f"http://127.0.0.1:{free_port()}"
    with ScriptedInstance(lambda path, body: {}) as decode, router([gone], [decode.url]) as client:
        with caplog.at_level(logging.INFO):
            time.sleep(0.7)                     # a few probes of each instance
        keyless = client.get("/health")
        assert keyless.status_code == 503 and keyless.json() == {"status": "unhealthy"}
        head = client.head("/health")                      # load balancers probe with HEAD
        assert head.status_code == 503 and head.content == b""
        detailed = client.get("/health", headers=AUTH).json()
        assert [b["status"] for b in detailed["prefill"]] == ["unreachable"]
        assert [b["url"] for b in detailed["decode"]] == [decode.url]
    probes = [r for r in caplog.records if r.levelno <= logging.INFO and "/health" in r.getMessage()]
    assert probes == []


def test_a_prefill_half_that_cannot_continue_runs_whole_and_one_that_can_runs_one_token():
    def spec(max_tokens: int, min_tokens: int = 0) -> ChoiceSpec:
        return ChoiceSpec(0, 0, [1, 2, 3], SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens))

    remote = {"do_remote_decode": True}
    [half] = with_kv_transfer(CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=6, kv_transfer_params=remote),
                              [spec(6, min_tokens=3)])
    assert half.export_kv and (half.params.max_tokens, half.params.min_tokens) == (1, 1)
    [whole] = with_kv_transfer(CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=1, kv_transfer_params=remote),
                               [spec(1)])
    assert not whole.export_kv and whole.params.max_tokens == 1
    # a chat prompt that leaves one token of room: its max_tokens defaults to 1; nothing to decode elsewhere
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], kv_transfer_params=remote)
    [whole] = with_kv_transfer(chat, [spec(1)])
    assert not whole.export_kv
