"""The HTTP layer against careless or hostile clients, in process (fake engine, ASGI transport).

Request-size limit (413 before the body is read, API key checked first), the API key on every route
but /health and /metrics, lone surrogates, empty / non-object bodies, error bodies without internal
details, HEAD /health, the start-up gate, tokenization off the event loop, the exposure warning.
The same over a real socket and a real `moe-serve`: test_server_hardening_process.py.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import httpx
import pytest
from server_harness import FakeEngine, serve_in_process

from moe_runtime.server import build_app
from moe_runtime.server.cli import build_parser, server_config_from_args
from moe_runtime.server.dashboard import dashboard_router
from moe_runtime.server.exposure import warn_if_exposed
from moe_runtime.server.server_config import ServerConfig

pytestmark = pytest.mark.timeout(60)

KEY = "sesame"
BEARER = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
INTERNALS = ("Traceback", "RuntimeError", "/opt/secret", "10.0.0.7", "rank 1 died", "fake engine bug")


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


class CharTokenizer:
    """Encodes one token per character (ids below the fake engine's vocabulary); optionally slow."""

    chat_template = None

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(self.delay_s)
        return [ord(c) % 500 for c in text]


class BrokenTokenizer(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("tokenizer crashed in /opt/secret/tokenize.py talking to 10.0.0.7:6000")


def engine_with(tokenizer=None, **kwargs) -> FakeEngine:
    engine = FakeEngine(**kwargs)
    engine.tokenizer = tokenizer
    return engine


# ---- 1. request size -------------------------------------------------------------------------

def http_scope(method: str, path: str, headers: dict[str, str]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


class LargeUpload:
    """An ASGI `receive` handing out a 16 MiB JSON body in 64 KiB chunks; counts what it handed out."""

    def __init__(self, total_bytes: int = 16 * 2**20, chunk_bytes: int = 64 * 1024):
        self.chunk = b"a" * chunk_bytes
        self.total_bytes = total_bytes
        self.calls = 0
        self.bytes = 0

    async def __call__(self) -> dict:
        self.calls += 1
        chunk = b'{"prompt": "' if self.bytes == 0 else self.chunk
        self.bytes += len(chunk)
        more = self.bytes < self.total_bytes
        return {"type": "http.request", "body": chunk if more else chunk + b'"}', "more_body": more}


def call_asgi(app, scope: dict, receive) -> tuple[int, dict[str, str], bytes]:
    sent = []

    async def send(message) -> None:
        sent.append(message)

    async def run():
        await asyncio.wait_for(app(scope, receive, send), 10)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


@pytest.fixture
def keyed_app():
    """build_app(api_key=KEY) with the default size limit (4 MiB) over a fake engine that is never reached."""
    from moe_runtime.front.async_engine import AsyncEngine

    return build_app(AsyncEngine(FakeEngine()), "fake", api_key=KEY)


def test_a_too_large_content_length_is_413_before_any_byte_is_read(keyed_app):
    upload = LargeUpload()
    status, headers, body = call_asgi(keyed_app, http_scope(
        "POST", "/v1/completions", {**BEARER, **JSON, "Content-Length": str(upload.total_bytes)}), upload)
    assert status == 413 and upload.calls == 0, body[:200]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close"   # the rest of the upload is not read


def test_a_streamed_body_is_cut_off_at_the_limit_without_buffering_more(keyed_app):
    upload = LargeUpload()
    status, headers, body = call_asgi(keyed_app, http_scope(
        "POST", "/v1/completions", {**BEARER, **JSON, "Transfer-Encoding": "chunked"}), upload)
    assert status == 413, body[:200]
    assert upload.bytes <= 4 * 2**20 + len(upload.chunk)
    assert "4 MiB" in json.loads(body)["error"]["message"] and headers["connection"] == "close"


@pytest.mark.parametrize("framing", [{"Content-Length": str(16 * 2**20)}, {"Transfer-Encoding": "chunked"}])
def test_the_api_key_is_checked_before_the_body_is_read(keyed_app, framing):
    upload = LargeUpload()
    status, headers, body = call_asgi(keyed_app, http_scope("POST", "/v1/completions", {**JSON, **framing}),
                                      upload)
    assert status == 401 and upload.calls == 0
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_max_request_bytes_sets_the_limit():
    async def scenario(client, _):
        within = await client.post("/v1/completions", json={"prompt": [7] * 100, "max_tokens": 2}, headers=BEARER)
        beyond = await client.post("/v1/completions", json={"prompt": [7] * 1000, "max_tokens": 2}, headers=BEARER)
        return within, beyond

    within, beyond = serve_in_process(FakeEngine(), scenario, api_key=KEY, max_request_bytes=1024)
    assert within.status_code == 200, within.text
    assert beyond.status_code == 413 and "1 KiB" in beyond.json()["error"]["message"]


def test_max_request_bytes_flag_reaches_the_server_config():
    assert ServerConfig().max_request_bytes == 4 * 2**20
    config = server_config_from_args(build_parser().parse_args(["--max-request-bytes", "1M"]))
    assert config.max_request_bytes == 2**20


def test_tokenization_runs_off_the_event_loop():
    async def scenario(client, _):
        start = time.perf_counter()
        request = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}))
        await asyncio.sleep(0.2)       # the request is being tokenized now (a blocked loop oversleeps)
        health = await client.get("/health")
        waited = time.perf_counter() - start - 0.2
        return health.status_code, waited, (await request).status_code

    health, waited, completion = serve_in_process(engine_with(CharTokenizer(delay_s=1.5)), scenario)
    assert health == 200 and completion == 200
    assert waited < 0.5, f"/health waited {waited:.2f}s behind a tokenization"


# ---- 2. lone surrogates ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", rb'{"prompt": "abc\ud800def"}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["fine", "\udc00"]}', "prompt.1"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
     "messages.0.content.0.text"),
])
def test_a_lone_surrogate_is_a_400_naming_the_parameter(tiny_tokenizer, path, raw, param):
    async def scenario(client, _):
        return await client.post(path, content=raw, headers=JSON)

    response = serve_in_process(engine_with(tiny_tokenizer, vocab_size=100_000), scenario)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and "surrogate" in error["message"]


def test_a_valid_surrogate_pair_is_fine(tiny_tokenizer):
    async def scenario(client, _):
        return await client.post("/v1/completions", content=rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}',
                                 headers=JSON)

    response = serve_in_process(engine_with(tiny_tokenizer, vocab_size=100_000), scenario)
    assert response.status_code == 200, response.text


# ---- 3. the API key on every route but /health and /metrics -------------------------------------

CLOSED = ["/docs", "/redoc", "/openapi.json", "/dashboard", "/dashboard/static/dashboard.js", "/dashboard/state",
          "/dashboard/trace", "/v1/models", "/v1/expert_load"]


def test_every_route_but_health_and_metrics_needs_the_key():
    async def scenario(client, _):
        async def statuses(headers):
            return {path: (await client.get(path, headers=headers)).status_code for path in CLOSED + ["/nowhere"]}

        open_routes = {path: (await client.get(path)).status_code for path in ("/health", "/metrics")}
        page = await client.get("/dashboard")
        return (open_routes, await statuses({}), await statuses(BEARER), await statuses(basic("anyone", KEY)),
                await statuses(basic(KEY, "wrong")), page.headers.get("www-authenticate", ""))

    router = dashboard_router(api_key=KEY)
    open_routes, without, bearer, basic_auth, wrong, challenge = serve_in_process(
        FakeEngine(), scenario, api_key=KEY, extra_routers=[router])
    assert open_routes == {"/health": 200, "/metrics": 200}
    assert without == dict.fromkeys(CLOSED + ["/nowhere"], 401)
    assert wrong == without
    expected = {path: 200 for path in CLOSED} | {"/v1/expert_load": 404, "/nowhere": 404}
    assert bearer == expected and basic_auth == expected   # a browser sends the key as a Basic password
    assert challenge.startswith("Basic")   # so the browser asks for it


def test_warns_when_listening_beyond_loopback_without_an_api_key(caplog):
    cases = [("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("example.org", None, True),
             ("0.0.0.0", "k", False), ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False)]
    for host, api_key, warns in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moe_runtime.server.exposure"):
            warn_if_exposed(ServerConfig(host=host, api_keys=(api_key,) if api_key else ()))
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "--api-key" in r.getMessage()]
        assert bool(warned) == warns, (host, api_key, caplog.text)


# ---- 4. HEAD /health, start-up ---------------------------------------------------------------

def test_head_health_is_200_without_a_body():
    async def scenario(client, _):
        return await client.head("/health"), await client.get("/health")

    head, get = serve_in_process(FakeEngine(), scenario, api_key=KEY)
    assert head.status_code == get.status_code == 200
    assert head.content == b""


def test_the_startup_gate_answers_503_until_the_app_is_ready():
    from moe_runtime.server.startup_gate import StartupGate

    async def ready_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ready"})

    gate = StartupGate()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://test") as client:
            before = [await client.get("/health"), await client.head("/health"),
                      await client.post("/v1/completions", json={"prompt": "x"}, headers=BEARER)]
            gate.open(ready_app)
            return before, await client.get("/health")

    (health, head, completion), after = asyncio.run(scenario())
    assert health.status_code == 503 and health.json() == {"status": "starting"}
    assert head.status_code == 503 and head.content == b""
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "starting"
    assert completion.headers["retry-after"]
    assert after.status_code == 200 and after.text == "ready"


# ---- 5. error bodies ---------------------------------------------------------------------------

def assert_no_internals(text: str) -> None:
    leaked = [word for word in INTERNALS if word in text]
    assert not leaked, f"{leaked} sent to the client: {text}"


def test_an_unexpected_error_is_a_short_500_and_the_detail_goes_to_the_log(caplog):
    async def scenario(client, _):
        return await client.post("/v1/completions", json={"prompt": "hello"})

    with caplog.at_level(logging.ERROR):
        response = serve_in_process(engine_with(BrokenTokenizer()), scenario, raise_app_exceptions=False)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error (see the server log)"
    assert_no_internals(response.text)
    assert "/opt/secret/tokenize.py" in caplog.text


@pytest.mark.parametrize("engine, logged", [(FakeEngine(step_delay_s=0.002, die_at_step=5), "rank 1 died"),
                                            (FakeEngine(step_delay_s=0.002, crash_at_step=5), "fake engine bug")],
                         ids=["dead", "crashed"])
def test_a_dead_engine_is_a_short_503_everywhere(engine, logged, caplog):
    async def scenario(client, _):
        dying = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 100})
        streamed = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 5, "stream": True})
        health = await client.get("/health")
        return dying, streamed, health

    with caplog.at_level(logging.WARNING):
        dying, streamed, health = serve_in_process(engine, scenario)
    assert dying.status_code == 503 and dying.json()["error"] == {
        "message": "the engine is unavailable", "type": "service_unavailable", "param": None, "code": "engine_dead"}
    assert streamed.status_code == 503 and streamed.json()["error"]["message"] == "the engine is unavailable"
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    for response in (dying, streamed, health):
        assert_no_internals(response.text)
    assert logged in caplog.text


def test_an_engine_dying_mid_stream_sends_a_short_error_event():
    async def scenario(client, _):
        return await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 100, "stream": True})

    response = serve_in_process(FakeEngine(step_delay_s=0.002, die_at_step=6), scenario)
    last = json.loads([line for line in response.text.splitlines() if line.startswith("data: ")][-1][6:])
    assert last["error"]["code"] == "engine_dead" and last["error"]["message"] == "the engine is unavailable"
    assert_no_internals(response.text)


# ---- 6. empty and non-object bodies --------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw,what", [(b"", "empty"), (b"  ", "empty"), (b"null", "null"), (b"[]", "array"),
                                      (b'"x"', "string"), (b"42", "number")])
def test_an_empty_or_non_object_body_is_a_clear_400(path, raw, what):
    async def scenario(client, _):
        return await client.post(path, content=raw, headers=JSON)

    response = serve_in_process(FakeEngine(), scenario)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "JSON object" in error["message"] and what in error["message"] and "None" not in error["message"]
    assert error["code"] == ("missing_body" if what == "empty" else "invalid_body")


def test_a_missing_parameter_is_still_named():
    async def scenario(client, _):
        return await client.post("/v1/completions", json={"max_tokens": 5})

    error = serve_in_process(FakeEngine(), scenario).json()["error"]
    assert error["param"] == "prompt" and error["code"] == "missing_parameter"
