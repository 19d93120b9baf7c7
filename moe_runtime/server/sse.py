"""Server-sent events: OpenAI's `data: {json}` chunks ending in `data: [DONE]`, or an error event then close.

The error event carries the same short body as an error response (`as_api_error`); the detail is logged.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from moe_runtime.server.errors import as_api_error

if TYPE_CHECKING:  # the P/D router streams with this module too, without the engine's imports (torch)
    from moe_runtime.server.generation import ChoiceEvent, Generation
    from moe_runtime.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_data(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def sse_stream(
    generation: Generation,
    metrics: ServerMetrics,
    opening: Callable[[], Iterable[BaseModel]],
    chunks: Callable[[ChoiceEvent], Iterable[BaseModel]],
    closing: Callable[[], Iterable[BaseModel]],
) -> AsyncIterator[str]:
    """The event stream of one generation. Leaving early (client gone) aborts its unfinished choices."""
    status = "aborted"
    try:
        for chunk in opening():
            yield sse_data(chunk)
        async for event in generation.events():
            for chunk in chunks(event):
                yield sse_data(chunk)
        for chunk in closing():
            yield sse_data(chunk)
        yield DONE
        status = "success"
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
        logger.warning("stream %s ended with an error: %s", generation.request_id, exc)
        error = as_api_error(exc)   # what the client may see: the detail stays in the log
        status = "error"
        yield sse_data(error.body())
    finally:
        generation.close()
        metrics.requests.inc(status)


class EventStreamResponse(StreamingResponse):
    """A streaming response whose body generator is always closed, even when the client leaves mid-send.

    Starlette cancels the sending task when the client disconnects; if that lands while a chunk is
    being sent (not inside the generator), the generator would only be finalised by the garbage
    collector. Closing it here runs its cleanup (aborting the request) right away.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
