"""Server-sent events: OpenAI's `data: {json}` chunks ending in `data: [DONE]`, or named events (the Responses and
Messages APIs), or an error event then close.

The error event carries the same short body as an error response (`as_api_error`), in the API's shape (the
formatter's `failure`); the detail is logged.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Iterable, Protocol

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from moe_runtime.server.errors import APIError, as_api_error

if TYPE_CHECKING:  # the P/D router streams with this module too, without the engine's imports (torch)
    from moe_runtime.server.generation import ChoiceEvent, Generation
    from moe_runtime.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_data(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class StreamFormatter(Protocol):
    """The events of one streamed answer, in the API's own shapes (pydantic models or dicts)."""

    def opening(self) -> Iterable[BaseModel | dict]: ...

    def chunks(self, event: "ChoiceEvent") -> Iterable[BaseModel | dict]: ...

    def closing(self) -> Iterable[BaseModel | dict]: ...

    def failure(self, error: APIError) -> Iterable[BaseModel | dict]:
        """The events telling the client its stream failed (the detail stays in the server log)."""
        ...


@dataclass(frozen=True)
class EventFraming:
    """How events go on the wire. OpenAI's chat and completions: `data: {json}` lines ending in `data: [DONE]`.
    The Responses and Messages APIs name each event after its `type` (`event: response.created`) and end
    without a marker."""

    named: bool = False
    end: str = DONE

    def frame(self, payload: BaseModel | dict) -> str:
        if not self.named:
            return sse_data(payload)
        body = payload.model_dump(mode="json", exclude_none=False) if isinstance(payload, BaseModel) else payload
        return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


OPENAI_CHUNKS = EventFraming()
NAMED_EVENTS = EventFraming(named=True, end="")


async def sse_stream(generation: Generation, metrics: ServerMetrics, formatter: StreamFormatter,
                     framing: EventFraming = OPENAI_CHUNKS) -> AsyncIterator[str]:
    """The event stream of one generation. Leaving early (client gone) aborts its unfinished choices."""
    status = "aborted"
    try:
        for payload in formatter.opening():
            yield framing.frame(payload)
        async for event in generation.events():
            for payload in formatter.chunks(event):
                yield framing.frame(payload)
        for payload in formatter.closing():
            yield framing.frame(payload)
        if framing.end:
            yield framing.end
        status = "success"
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
        logger.warning("stream %s ended with an error: %s", generation.request_id, exc)
        error = as_api_error(exc)   # what the client may see: the detail stays in the log
        status = "error"
        for payload in formatter.failure(error):
            yield framing.frame(payload)
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
