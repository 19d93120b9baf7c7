"""The router's FastAPI app: /v1/completions, /v1/chat/completions (streamed or not), /v1/models, /health,
/metrics. The same gates as moe-serve's own app run first: the client's API key, then the body size."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from moe_runtime.server.auth import ApiKeyGate, key_matches
from moe_runtime.server.body_limit import RequestSizeLimit
from moe_runtime.server.errors import install_error_handlers
from moe_runtime.server.pd_router.backends import BackendPool, NoBackend
from moe_runtime.server.pd_router.forwarding import Forwarder, error_response, parse_body
from moe_runtime.server.pd_router.health import keep_probing, probe_all, quiet_http_client_log
from moe_runtime.server.pd_router.metrics import RouterMetrics
from moe_runtime.server.server_config import DEFAULT_MAX_REQUEST_BYTES
from moe_runtime.server.head_requests import HeadAsGet


def build_router_app(pool: BackendPool, api_key: str | None = None, backend_api_key: str | None = None,
                     max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, probe_interval_s: float = 1.0,
                     request_timeout_s: float = 600.0) -> FastAPI:
    """`backend_api_key` is what the router sends the instances (their --api-key); `api_key` its clients'."""
    metrics = RouterMetrics(pool)
    state: dict = {}
    quiet_http_client_log()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["forwarder"] = Forwarder(pool, client, metrics, backend_api_key)
            state["client"] = client
            await probe_all(client, pool)
            prober = asyncio.create_task(keep_probing(client, pool, probe_interval_s))
            try:
                yield
            finally:
                prober.cancel()

    app = FastAPI(title="moe-serve router", lifespan=lifespan)
    app.state.pool = pool
    install_error_handlers(app)
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    app.add_middleware(ApiKeyGate, api_key=api_key)
    app.add_middleware(HeadAsGet)   # load balancers probe /health with HEAD

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["forwarder"].forward("completions", parse_body(await request.body()), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["forwarder"].forward("chat", parse_body(await request.body()), request)

    @app.get("/v1/models")
    async def models() -> Response:
        """The decode instances' model list (every instance of a set serves the same model)."""
        try:
            backend = pool.choose("decode")
        except NoBackend as exc:
            return error_response(503, str(exc), "service_unavailable")
        headers = state["forwarder"].headers
        try:
            response = await state["client"].get(backend.url + "/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            return error_response(502, f"the decode instance {backend.url} failed: {type(exc).__name__}",
                                  "decode_failed")
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while every role has a healthy instance, else 503. The body is only the status, except to a
        caller with the API key (or when there is none): then each instance, where it is and its counters
        (the route is open to probes, and topology is no business of theirs)."""
        healthy, body = pool.health()
        if api_key is not None and not key_matches(request.headers.get("authorization", ""), api_key):
            body = {"status": body["status"]}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
