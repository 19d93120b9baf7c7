"""The request-size limit: 413 for a body larger than `max_request_bytes`, decided while it streams in.

`RequestSizeLimit` is a pure ASGI middleware. A Content-Length above the limit is refused before a
byte is read; a body without one (chunked) is counted as `receive()` hands it over and refused as
soon as the count passes the limit, so at most the limit plus one chunk is ever held. The refusal
closes the connection: the rest of the upload is never read.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.server.errors import APIError



class RequestTooLarge(Exception):
    """Raised into the app by `receive()` once the body passed the limit (the middleware answers 413)."""


def declares_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a request announces a body (an answer sent before reading it then closes the connection)."""
    return headers.get(b"content-length", b"0").strip() not in (b"", b"0") or b"transfer-encoding" in headers


def readable_size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({readable_size(limit)}; "
                         "see --max-request-bytes)", "invalid_request_error", None, "request_too_large")


@dataclass
class _Upload:
    """One request's body as counted so far, and whether the app's response was replaced by the 413."""

    received: int = 0
    exceeded: bool = False
    response_started: bool = False


@dataclass
class RequestSizeLimit:
    """ASGI middleware: 413 (and the connection closed) for a request body larger than `max_bytes`."""

    app: object
    max_bytes: int

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        upload = _Upload()

        async def counting_receive() -> dict:
            if upload.exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                upload.received += len(message.get("body", b""))
                if upload.received > self.max_bytes:
                    upload.exceeded = True
                    raise RequestTooLarge()
            return message

        async def guarded_send(message: dict) -> None:
            if upload.exceeded:
                return   # whatever the app makes of the interrupted read, the client gets the 413
            if message["type"] == "http.response.start":
                upload.response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not upload.exceeded:
                raise
            # RequestTooLarge, or what the app's body parsing turned it into: answered below
        if upload.exceeded and not upload.response_started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        response = too_large(self.max_bytes).response(scope["path"])   # in the shape of the path's API
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
