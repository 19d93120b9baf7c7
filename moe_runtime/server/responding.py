"""One generation answered: streamed as server-sent events, or read whole and returned as one body.

Every generating route ends here (`respond`), whatever its API: the formatter gives the API's shapes, the
framing how streamed events go on the wire (`server.sse`). A whole answer whose client left is aborted
(`abort_on_disconnect`), and one the engine aborted answers 499 in the API's error shape.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from moe_runtime.errors import MoERuntimeError
from moe_runtime.server.errors import APIError, as_api_error
from moe_runtime.server.generation import ChoiceEvent, Generation
from moe_runtime.server.metrics import ServerMetrics
from moe_runtime.server.sse import OPENAI_CHUNKS, EventFraming, EventStreamResponse, StreamFormatter, sse_stream

logger = logging.getLogger(__name__)


class AnswerFormatter(StreamFormatter, Protocol):
    """A streamed answer's events (`StreamFormatter`), or a whole answer: `add` every event, then `response`."""

    def add(self, event: ChoiceEvent) -> None: ...

    def response(self) -> BaseModel | dict: ...

    def error_body(self, error: APIError) -> dict:
        """An error response's body in the API's shape."""
        ...


async def respond(generation: Generation, formatter: AnswerFormatter, stream: bool, request: Request,
                  metrics: ServerMetrics, framing: EventFraming = OPENAI_CHUNKS) -> Response | BaseModel | dict:
    try:
        await generation.start()
    except MoERuntimeError as exc:  # refused: invalid, queue full, engine dead
        raise as_api_error(exc) from exc
    if stream:
        return EventStreamResponse(sse_stream(generation, metrics, formatter, framing))
    watcher = asyncio.create_task(abort_on_disconnect(request, generation))
    try:
        async for event in generation.events():
            formatter.add(event)
    except MoERuntimeError as exc:  # the engine died under the request
        raise as_api_error(exc) from exc
    finally:
        watcher.cancel()
        generation.close()
    if any(t.finish_reason == "abort" for t in generation.trackers.values()):
        metrics.requests.inc("aborted")
        return JSONResponse(formatter.error_body(APIError(499, "the client closed the request", "aborted")),
                            status_code=499)
    metrics.requests.inc("success")
    body = formatter.response()
    kv_transfer_params = generation.kv_transfer_params()
    if kv_transfer_params is not None:   # a prefill instance's answer: where the prompt's KV waits
        return JSONResponse({**body.model_dump(mode="json"), "kv_transfer_params": kv_transfer_params})
    return body   # FastAPI serializes a model or a dict


async def abort_on_disconnect(request: Request, generation: Generation) -> None:
    """A plain (non-streamed) request whose client left is aborted: nobody will read its answer.

    The body has been read, so the server's next ASGI message for this request is the disconnect:
    wait for it (no polling); the response finishing first cancels this watcher.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    if not generation.finished:
        logger.info("client of %s disconnected; aborting", generation.request_id)
        generation.close()
