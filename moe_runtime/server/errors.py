"""Error bodies and the app's handlers: OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) on
every path but the Messages API's, which answer in Anthropic's (`{"type": "error", "error": {"type", "message"}}`,
`speaks_anthropic`), so each API's client reads its own errors: the official `anthropic` client raises by
status and reads `error.type` and `error.message`. Whoever answers an error (a handler, a middleware, a stream's
error event) picks the shape by the request's path (`APIError.response(path)`).

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
ANTHROPIC_PATH = "/v1/messages"   # the Messages API's routes (and any path below): errors in Anthropic's shape
# Anthropic's error types by HTTP status; any other 4xx is an invalid request, any other 5xx an api_error. A 503
# (starting, draining, engine gone) is Anthropic's "overloaded": try again later, perhaps elsewhere.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


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

    def anthropic_body(self) -> dict:
        """Anthropic's shape: its error type follows from the status (`ANTHROPIC_ERROR_TYPES`). It has no `param`:
        the message names the parameter at fault (led by it, where the message alone does not)."""
        message = self.message
        if self.param is not None and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": anthropic_error_type(self.status), "message": message}}

    def body_for(self, path: str | None) -> dict:
        """The body in the shape of the API that `path` belongs to (None: OpenAI's)."""
        return self.anthropic_body() if speaks_anthropic(path) else self.body()

    def response(self, path: str | None = None) -> JSONResponse:
        """The error response to a request for `path` (its API's shape; None: OpenAI's)."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body_for(path), status_code=self.status, headers=headers)


def speaks_anthropic(path: str | None) -> bool:
    """Whether `path` is one of the Messages API's (`/v1/messages`, `/v1/messages/count_tokens`, ...)."""
    return path is not None and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


def anthropic_error_type(status: int) -> str:
    known = ANTHROPIC_ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


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
    """Every error a route raises, answered in its API's shape (by the request's path: `APIError.response`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.scope["path"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response(request.scope["path"])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind, None, None).response(request.scope["path"])

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response(request.scope["path"])
