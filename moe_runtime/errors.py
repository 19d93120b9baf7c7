"""Errors the engine raises on bad input; each names the thing at fault."""


class MoERuntimeError(Exception):
    """Base class of every error this runtime raises on purpose."""


class CheckpointError(MoERuntimeError):
    """A checkpoint directory is missing a file, a tensor, or holds a tensor of the wrong shape."""


class UnsupportedArchitectureError(MoERuntimeError):
    """config.json names an architecture this runtime does not implement."""


class InvalidRequestError(MoERuntimeError, ValueError):
    """A request or sampling parameter is out of range; the message names the parameter."""


class EngineDeadError(MoERuntimeError):
    """A worker process of the engine died; the message names the rank."""


class RequestFailedError(MoERuntimeError):
    """The engine failed this one request (sampling or detokenizing it raised); the engine and every
    other request carry on. The message is short and safe to show the client."""

    def __init__(self, request_id: str, error: str):
        super().__init__(f"request {request_id} failed in the engine: {error}")
        self.request_id = request_id
        self.error = error


class QueueFullError(MoERuntimeError):
    """Too many requests are waiting for their first token; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(MoERuntimeError):
    """The server is draining before it stops (SIGTERM): it takes no new request, the running ones finish.
    Retry after `retry_after_s`, on another instance."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def error_message(exc: BaseException, limit: int = 200) -> str:
    """A short, one-line description of `exc` for `RequestOutput.error` (clients see it)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
