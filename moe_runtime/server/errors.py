"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`) and the app's handlers.

What a client is told is meant for the client: a 4xx names the parameter at fault; a 5xx says only
what failed (the engine is unavailable, it failed this request, an internal error). Internal details
(exception reprs, source paths, ranks' addresses and ports, tracebacks) go to the server log, never
into a response.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_runtime.errors import (EngineDeadError, InvalidRequestError, QueueFullError, RequestFailedError,
                                ShuttingDownError)

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal error (see the server log)"
ENGINE_UNAVAILABLE_MESSAGE = "the engine is unavailable"
REQUEST_FAILED_MESSAGE = "the engine failed this request"
MAX_ECHOED_CHARS = 120   # a client's own value quoted back in a 400, shortened beyond this


@dataclass
class APIError(Exception):
    """An error the API returns as-is: HTTP status plus the OpenAI error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def as_api_error(exc: BaseException) -> APIError:
    """Map what the engine layer raises to the API error a client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), "invalid_request_error", _param_named_in(str(exc)))
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_exceeded", None, "queue_full", retry_after_s=exc.retry_after_s)
    if isinstance(exc, ShuttingDownError):   # draining before a stop: another instance can take it
        return APIError(503, str(exc), "service_unavailable", None, "shutting_down", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        logger.warning("request refused, the engine is unavailable: %s", exc)
        return engine_unavailable()
    if isinstance(exc, RequestFailedError):
        # the engine caught and described the failure, and serves the other requests on: no traceback
        logger.warning("%s", exc)
        return APIError(500, REQUEST_FAILED_MESSAGE, "internal_server_error", None, "request_failed")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, INTERNAL_ERROR_MESSAGE, "internal_server_error", None, "internal_error")


def engine_unavailable() -> APIError:
    """503 for a dead engine; why it died (ranks, exit codes, peers' addresses) is in the server log."""
    return APIError(503, ENGINE_UNAVAILABLE_MESSAGE, "service_unavailable", None, "engine_dead")


def _param_named_in(message: str) -> str | None:
    """`SamplingParams.top_p=...` -> "top_p": the engine's messages name the parameter that way."""
    prefix = "SamplingParams."
    if message.startswith(prefix):
        return message[len(prefix):].split("=", 1)[0]
    if message.startswith("prompt"):
        return "prompt"
    return None


def validation_error(errors: Sequence[dict]) -> APIError:
    """A pydantic validation failure (its `errors()`) as one 400 naming the first offending field."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "missing":
        return bad_request(f"missing required parameter {param!r}", param, "missing_parameter")
    if param is None:
        return bad_request(f"invalid request body: {first.get('msg')}", code="invalid_body")
    return bad_request(f"invalid value for {param!r}: {first.get('msg')} (got {short_repr(first.get('input'))})",
                       param, "invalid_value")


def short_repr(value: object) -> str:
    """repr() of a client's value, cut short: a 4 MiB prompt of the wrong type is not worth sending back."""
    text = repr(value)
    return text if len(text) <= MAX_ECHOED_CHARS else f"{text[:MAX_ECHOED_CHARS]}... ({len(text)} characters)"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind, None, None).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()
