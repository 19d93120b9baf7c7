"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API.

A request runs as a chat (`conversion`) through the app's conversion threads, tenant salts, engine and metrics
(`ServingContext`), and is answered as a message (`formatter`). count_tokens renders the same conversation the
same way and counts its tokens, without generating. Errors on these paths are in Anthropic's shape
(`server.errors.speaks_anthropic`), the API key may come as `x-api-key` (`server.auth`).
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from moe_runtime.server.conversion_threads import declared_length
from moe_runtime.server.errors import validation_error
from moe_runtime.server.generation import Generation
from moe_runtime.server.json_body import documented_body, json_body
from moe_runtime.server.messages.conversion import MessagesConversion, as_chat_request, shows_thinking
from moe_runtime.server.messages.formatter import MessagesFormatter
from moe_runtime.server.messages.protocol import CountTokensResponse, MessagesBody, MessagesRequest
from moe_runtime.server.request_conversion import ModelInfo, chat_choices
from moe_runtime.server.responding import respond
from moe_runtime.server.serving_context import ServingContext
from moe_runtime.server.sse import NAMED_EVENTS



def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def messages_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def convert(body: MessagesBody, model: ModelInfo, request: Request) -> MessagesConversion:
        """In a conversion thread: the chat request (salted for the caller's tenant), rendered and tokenized."""
        model.unknown_fields.warn_new(body, request.scope["path"])
        try:
            chat_request = as_chat_request(body, harmony=ctx.harmony is not None)
        except ValidationError as exc:   # a bound only the chat request checks, named as chat's field
            raise validation_error(exc.errors()) from None
        return MessagesConversion(chat_choices(ctx.salts.salted(chat_request, request), model), shows_thinking(body))

    @router.post("/messages", openapi_extra=documented_body(MessagesRequest))
    async def create_message(request: Request, body: MessagesRequest = Depends(json_body(MessagesRequest))):
        converted = await ctx.conversions.run(convert, body, ctx.model, request,
                                              body_bytes=declared_length(request.headers))
        generation = Generation(ctx.async_engine, message_id(), converted.chat.choices, ctx.metrics)
        formatter = MessagesFormatter(generation, ctx.served_model_name, converted.reading(ctx.reasoning, ctx.harmony),
                                      thinking=converted.thinking)
        return await respond(generation, formatter, body.stream, request, ctx.metrics, NAMED_EVENTS)

    @router.post("/messages/count_tokens", openapi_extra=documented_body(MessagesBody))
    async def count_tokens(request: Request,
                           body: MessagesBody = Depends(json_body(MessagesBody))) -> CountTokensResponse:
        """The prompt's tokens as /v1/messages would run it (no max_tokens: the context's rest, as chat's default)."""
        converted = await ctx.conversions.run(convert, body, ctx.model, request,
                                              body_bytes=declared_length(request.headers))
        return CountTokensResponse(input_tokens=len(converted.chat.choices[0].prompt_token_ids))

    return router
