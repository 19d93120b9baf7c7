"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A request runs as a chat (`chat_request`) through the app's conversion threads, engine and metrics
(`ServingContext`). With `store` (OpenAI's default) the answer and its conversation are kept in the
`ResponseStore` under the caller's API key, for `previous_response_id` and GET. With `background` (off by
default; it needs `store`) the route answers at once with the response `in_progress` (`queued` until
the engine takes it) and the generation goes on; GET shows where it stands, cancel aborts it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from moe_runtime.errors import MoERuntimeError
from moe_runtime.server.auth import KEY_INDEX_STATE
from moe_runtime.server.conversion_threads import declared_length
from moe_runtime.server.errors import APIError, as_api_error, bad_request, validation_error
from moe_runtime.server.generation import Generation
from moe_runtime.server.json_body import documented_body, json_body
from moe_runtime.server.protocol import ChatMessage
from moe_runtime.server.request_conversion import ChatConversion, ModelInfo, chat_choices
from moe_runtime.server.responding import respond
from moe_runtime.server.responses.chat_request import as_chat_request, in_responses_terms
from moe_runtime.server.responses.formatter import ResponsesFormatter
from moe_runtime.server.responses.input_items import conversation
from moe_runtime.server.responses.output_items import OutputItem, item_id
from moe_runtime.server.responses.protocol import ResponsesRequest
from moe_runtime.server.responses.store import ResponseStore
from moe_runtime.server.serving_context import ServingContext
from moe_runtime.server.sse import NAMED_EVENTS

logger = logging.getLogger(__name__)
ENDPOINT = "/v1/responses"


@dataclass(frozen=True)
class ConvertedResponse:
    messages: list[ChatMessage]   # the conversation prompted (previous response's, then this input), no instructions
    chat: ChatConversion


def echoed_settings(request: ResponsesRequest) -> dict:
    """The request's settings as a response repeats them (OpenAI's response object carries them)."""
    text_format = (request.text.format.model_dump(by_alias=True, exclude_none=True)
                   if request.text is not None and request.text.format is not None else {"type": "text"})
    return {"instructions": request.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": {"format": text_format},
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "max_output_tokens": request.max_output_tokens, "previous_response_id": request.previous_response_id,
            "store": request.store, "background": request.background, "metadata": request.metadata or {},
            "truncation": request.truncation or "disabled", "user": request.user}


def assistant_turn(items: list[OutputItem]) -> ChatMessage:
    """An answer's items as the assistant message a follow-up's conversation replays."""
    content = "".join(item.text for item in items if item.kind == "message")
    reasoning = "".join(item.text for item in items if item.kind == "reasoning")
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.text}}
             for item in items if item.kind == "function_call"]
    return ChatMessage(role="assistant", content=content or None, tool_calls=calls or None,
                       reasoning_content=reasoning or None)


def stored_size(messages: list[ChatMessage], body: dict) -> int:
    """Bytes an entry is counted for: its conversation's and its body's JSON."""
    return sum(len(message.model_dump_json()) for message in messages) + len(json.dumps(body))


@dataclass
class BackgroundResponses:
    """Generations that answer in the background, by response id (a finished one leaves)."""

    running: dict[tuple[int | None, str], Generation] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)


def responses_router(ctx: ServingContext, store: ResponseStore) -> APIRouter:
    router = APIRouter(prefix="/v1")
    background = BackgroundResponses()

    def convert(body: ResponsesRequest, model: ModelInfo, prior: tuple[ChatMessage, ...],
                request: Request) -> ConvertedResponse:
        model.unknown_fields.warn_new(body, ENDPOINT)
        messages = [*prior, *conversation(body.input)]
        try:
            chat_request = as_chat_request(body, messages, harmony=ctx.harmony is not None)
        except ValidationError as exc:   # a field the chat request bounds (stop, ...), named as this request's
            raise validation_error(exc.errors()) from None
        try:
            return ConvertedResponse(messages, chat_choices(ctx.salts.salted(chat_request, request), model))
        except APIError as error:
            raise in_responses_terms(error) from None

    def count_tokens(text: str) -> int:
        return len(ctx.model.tokenizer.encode(text, add_special_tokens=False)) if ctx.model.tokenizer else 0

    @router.post("/responses", openapi_extra=documented_body(ResponsesRequest))
    async def create_response(request: Request, body: ResponsesRequest = Depends(json_body(ResponsesRequest))):
        tenant = getattr(request.state, KEY_INDEX_STATE, None)
        if body.background and not body.store:
            raise bad_request("background responses are kept to be fetched: they need store=true", "background")
        if body.background and body.stream:
            raise bad_request("a background response is fetched with GET /v1/responses/{id}, not streamed: "
                              "give background or stream", "background")
        prior: tuple[ChatMessage, ...] = ()
        if body.previous_response_id is not None:
            stored = store.get(tenant, body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} is not stored here (unknown, "
                               "expired, or not stored)", "invalid_request_error", "previous_response_id",
                               "previous_response_not_found")
            prior = stored.conversation
        converted = await ctx.conversions.run(convert, body, ctx.model, prior, request,
                                              body_bytes=declared_length(request.headers))
        response_id = item_id("resp")
        generation = Generation(ctx.async_engine, response_id, converted.chat.choices, ctx.metrics)

        def keep(final: dict, items: list[OutputItem]) -> None:
            if body.store:
                messages = [*converted.messages, assistant_turn(items)]
                if not store.put(tenant, response_id, messages, final, stored_size(messages, final)):
                    logger.warning("response %s is larger than the whole response store: not kept", response_id)

        formatter = ResponsesFormatter(generation, response_id, ctx.served_model_name, echoed_settings(body),
                                       converted.chat.reading(ctx.reasoning, ctx.harmony), count_tokens, keep)
        if body.background:
            return await start_background(tenant, generation, formatter)
        return await respond(generation, formatter, body.stream, request, ctx.metrics, NAMED_EVENTS)

    async def start_background(tenant: int | None, generation: Generation, formatter: ResponsesFormatter) -> dict:
        try:
            await generation.start()
        except MoERuntimeError as exc:
            raise as_api_error(exc) from exc
        pending = formatter.shell("in_progress")
        store.put(tenant, formatter.response_id, [], pending, len(json.dumps(pending)))
        key = (tenant, formatter.response_id)
        background.running[key] = generation

        async def run() -> None:
            try:
                async for event in generation.events():
                    formatter.add(event)
                if any(t.finish_reason == "abort" for t in generation.trackers.values()):
                    cancelled = formatter.shell("cancelled")
                    store.put(tenant, formatter.response_id, [], cancelled, len(json.dumps(cancelled)))
                else:
                    formatter.response()   # stores the final body (`keep`)
                    ctx.metrics.requests.inc("success")
            except Exception as exc:  # noqa: BLE001 - recorded in the stored response, as OpenAI's `failed`
                error = as_api_error(exc)
                failed = {**formatter.shell("failed"), "error": {"code": error.code or error.type,
                                                                 "message": error.message}}
                store.put(tenant, formatter.response_id, [], failed, len(json.dumps(failed)))
            finally:
                generation.close()
                background.running.pop(key, None)

        task = asyncio.create_task(run())
        background.tasks.add(task)
        task.add_done_callback(background.tasks.discard)
        return pending

    def stored_or_404(request: Request, response_id: str):
        stored = store.get(getattr(request.state, KEY_INDEX_STATE, None), response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", "invalid_request_error", "response_id",
                           "response_not_found")
        return stored

    @router.get("/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse(stored_or_404(request, response_id).body)

    @router.delete("/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> JSONResponse:
        stored_or_404(request, response_id)
        tenant = getattr(request.state, KEY_INDEX_STATE, None)
        running = background.running.get((tenant, response_id))
        if running is not None:
            running.close()
        store.delete(tenant, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.post("/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> JSONResponse:
        stored = stored_or_404(request, response_id)
        running = background.running.get((getattr(request.state, KEY_INDEX_STATE, None), response_id))
        if running is None:
            raise bad_request(f"response {response_id!r} is {stored.body.get('status')}: only a background "
                              "response in progress can be cancelled", "response_id")
        running.close()
        return JSONResponse({**stored.body, "status": "cancelled"})

    return router
