"""The FastAPI app: OpenAI completions and chat (plain and SSE), models, health, metrics, expert load,
vLLM's /tokenize, /detokenize and /version.

`build_app` takes a started `AsyncEngine`; the caller owns its lifecycle. Extra routers and
mounts (the dashboard) plug in through `extra_routers` / `mounts`; they find the engine and the
metrics on `app.state.async_engine` and `app.state.metrics`.

HEAD answers on every GET route (`HeadAsGet`). Before any route, from the headers alone: the API key
(every route but /health and /metrics, `ApiKeyGate`), then the body size (`RequestSizeLimit`). Bodies are
parsed and prompts tokenized off the event loop, so one large request cannot stall /health or the other
requests' streams.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import moe_runtime
from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.errors import MoERuntimeError
from moe_runtime.server.auth import ApiKeyGate, ApiKeys
from moe_runtime.server.body_limit import RequestSizeLimit
from moe_runtime.server.chat import ChatFormatter
from moe_runtime.server.completions import CompletionFormatter
from moe_runtime.server.conversion_threads import ConversionThreads, declared_length
from moe_runtime.server.errors import APIError, as_api_error, install_error_handlers
from moe_runtime.server.weight_update_routes import weight_update_router
from moe_runtime.server.generation import Generation
from moe_runtime.server.head_requests import HeadAsGet
from moe_runtime.server.json_body import documented_body, install_body_schemas, json_body
from moe_runtime.server.logprobs import TokenNamer
from moe_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from moe_runtime.server.messages.protocol import MessagesBody, MessagesRequest
from moe_runtime.server.messages.routes import messages_router
from moe_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from moe_runtime.server.prompt_size import PromptSizeBound
from moe_runtime.server.request_conversion import ModelInfo, chat_choices, check_model, completion_choices
from moe_runtime.server.server_config import DEFAULT_MAX_REQUEST_BYTES
from moe_runtime.server.responding import respond
from moe_runtime.server.responses.protocol import ResponsesRequest
from moe_runtime.server.responses.routes import responses_router
from moe_runtime.server.responses.store import ResponseStore
from moe_runtime.server.serving_context import ServingContext
from moe_runtime.server.stream_usage import stream_usage
from moe_runtime.server.tenant_salt import TenantSalts
from moe_runtime.server.tokenization import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                             detokenize, tokenize)
from moe_runtime.server.harmony_output import HarmonyFormat
from moe_runtime.server.reasoning.selection import choose_reasoning
from moe_runtime.server.tool_calls.selection import choose_parser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mount:
    """An ASGI app (e.g. `StaticFiles(directory=...)`) mounted under `path`."""

    path: str
    app: object
    name: str | None = None


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | Sequence[str] | None = None,
    extra_routers: Sequence[APIRouter] = (),
    mounts: Sequence[Mount] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
    model_type: str | None = None,
    reasoning_parser: str | None = None,
    admin_key: str | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """`tool_call_parser` names the parser of tool calls (`server.tool_calls.selection.PARSERS`); None chooses
    one from the chat template, then `model_type` (config.json's). `reasoning_parser` names the reasoning
    split (`server.reasoning.selection`; a gpt-oss `model_type` gets harmony in any case). `api_key`: one key, or one per tenant (each
    tenant's requests then share prefix-cache blocks only among themselves: `server.tenant_salt`). `admin_key`:
    the operator's key, which the routes acting on every tenant need (`server.admin_routes`). `response_store`
    keeps the Responses API's answers (`server.responses.store`; None: one with the default bounds)."""
    app = FastAPI(title="moe-runtime", version=moe_runtime.__version__)
    app.state.async_engine = async_engine
    app.state.metrics = metrics = ServerMetrics()
    parser = choose_parser(tool_call_parser, getattr(async_engine.tokenizer, "chat_template", None), model_type)
    reasoning = choose_reasoning(reasoning_parser, model_type)
    harmony = HarmonyFormat(async_engine.tokenizer) if reasoning.harmony else None
    tokenizer = async_engine.tokenizer
    model = ModelInfo(served_model_name, async_engine.max_model_len, tokenizer, parser,
                      structured_output=async_engine.structured_output_validator, harmony=harmony,
                      prompt_size=PromptSizeBound.of(tokenizer, async_engine.max_model_len))
    conversions = ConversionThreads()
    namer = TokenNamer(async_engine.tokenizer)
    salts = TenantSalts.for_keys(ApiKeys.of(api_key))
    app.state.serving = ServingContext(async_engine, model, metrics, conversions, salts, namer, reasoning, harmony)
    install_error_handlers(app)
    install_body_schemas(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                               ResponsesRequest, MessagesRequest, MessagesBody])

    # the last added runs first: HEAD as GET, count refusals, check the key, then the size, then route
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    app.add_middleware(ApiKeyGate, api_key=api_key, admin_key=admin_key)
    app.add_middleware(RefusalCounter, metrics=metrics)
    app.add_middleware(HeadAsGet)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=async_engine.max_model_len)])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        """The served model's card; any other id is a 404 (OpenAI's `model_not_found`). Ids may hold slashes."""
        check_model(model_id, model)
        return ModelCard(id=served_model_name, max_model_len=async_engine.max_model_len)

    @app.post("/tokenize", openapi_extra=documented_body(TokenizeRequest))
    async def tokenize_route(request: Request,
                             body: TokenizeRequest = Depends(json_body(TokenizeRequest))) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt or chat messages to token ids (off the event loop)."""
        return await conversions.run(tokenize, body, model, body_bytes=declared_length(request.headers))

    @app.post("/detokenize", openapi_extra=documented_body(DetokenizeRequest))
    async def detokenize_route(body: DetokenizeRequest = Depends(json_body(DetokenizeRequest))) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids (inside the vocabulary) to text (off the event loop)."""
        return await asyncio.to_thread(detokenize, body, model)

    @app.get("/version")
    async def version() -> dict:
        return {"version": moe_runtime.__version__}

    @v1.post("/completions", openapi_extra=documented_body(CompletionRequest))
    async def completions(request: Request, body: CompletionRequest = Depends(json_body(CompletionRequest))):
        body = salts.salted(body, request)
        usage = stream_usage(body)
        choices = await conversions.run(completion_choices, body, model,   # tokenizes: off the event loop
                                        body_bytes=declared_length(request.headers))
        generation = Generation(async_engine, f"cmpl-{uuid.uuid4().hex}", choices, metrics)
        formatter = CompletionFormatter(generation, served_model_name, namer, body.logprobs is not None, usage.final,
                                        continuous_usage=usage.continuous,
                                        echo=body.echo, num_logprobs=body.logprobs or 0,
                                        prompt_logprobs=body.prompt_logprobs)
        return await respond(generation, formatter, body.stream, request, metrics)

    @v1.post("/chat/completions", openapi_extra=documented_body(ChatCompletionRequest))
    async def chat_completions(request: Request,
                               body: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))):
        body = salts.salted(body, request)
        usage = stream_usage(body)
        chat = await conversions.run(chat_choices, body, model,   # renders and tokenizes: off the event loop
                                     body_bytes=declared_length(request.headers))
        generation = Generation(async_engine, f"chatcmpl-{uuid.uuid4().hex}", chat.choices, metrics)
        formatter = ChatFormatter(generation, served_model_name, namer, body.logprobs, usage.final,
                                  continuous_usage=usage.continuous, reading=chat.reading(reasoning, harmony))
        return await respond(generation, formatter, body.stream, request, metrics)

    @app.get("/health")
    async def health() -> Response:
        """200 {"status": "ok"} or 503 {"status": "unhealthy"} (why is in the server log: this route is open);
        200 {"status": "degraded"} while the ranks restart after a lost one (requests are taken and wait);
        503 {"status": "draining"} once SIGTERM came, so load balancers send the requests elsewhere, and
        503 {"status": "unhealthy"} once the server stops (its requests end)."""
        if async_engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if async_engine.stopping:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        health = async_engine.front.health()
        status = "unhealthy" if not health.healthy else "degraded" if health.degraded else "ok"
        return JSONResponse({"status": status}, status_code=200 if health.healthy else 503)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Every DP worker forgets its cached KV blocks (an admin route: `server.admin_routes`; blocks in use stay
        with their requests). Benchmarks call it between runs; a new model revision behind the same name needs it."""
        try:
            async_engine.reset_prefix_cache()
        except MoERuntimeError as exc:
            raise as_api_error(exc) from exc
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Request metrics and the engine's state, with the expert load /v1/expert_load serves: the engine's
        shared snapshot, refreshed at most every `expert_load_refresh_s` (a snapshot pauses every rank, and
        this route is open: a scrape must never send the ranks a command of its own)."""
        expert_load = await async_engine.recent_expert_load()
        return PlainTextResponse(metrics.render(async_engine, expert_load), media_type=CONTENT_TYPE)

    @v1.get("/expert_load")
    async def expert_load() -> Response:
        snapshot = await async_engine.recent_expert_load()   # shared with /metrics, never one per request
        if snapshot is None:
            return APIError(404, "this engine records no expert load (a single-rank engine, or no MoE layers)",
                            "not_found_error", None, "no_expert_load").response()
        return JSONResponse(snapshot.to_dict())

    app.include_router(v1)
    app.include_router(weight_update_router(async_engine))   # admin: weight updates, sleep, wake
    app.include_router(responses_router(app.state.serving, response_store or ResponseStore()))
    app.include_router(messages_router(app.state.serving))
    for router in extra_routers:
        app.include_router(router)
    for mount in mounts:
        app.mount(mount.path, mount.app, name=mount.name)
    return app


class RefusalCounter:
    """ASGI middleware: count every POST /v1 request answered with an error status.

    The handlers count their own outcomes (success, aborted, errors inside a stream). A plain ASGI
    middleware, not `BaseHTTPMiddleware`, so streamed bodies and client disconnects pass straight through.
    """

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def send_counting(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and message["status"] != 499:
                self.metrics.requests.inc(status_label(message["status"]))
            await send(message)

        await self.app(scope, receive, send_counting)


def status_label(http_status: int) -> str:
    if http_status == 429:
        return "rejected"
    if http_status == 401:
        return "unauthorized"
    if http_status < 500:
        return "bad_request"
    return "error"
