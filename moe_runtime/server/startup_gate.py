"""What `moe-serve` answers while its engine is still being built: 503, until `open(app)` hands over.

The server listens before the engine exists (loading a model and starting ranks takes long), so a
probe or a client gets an answer at once instead of a connection that hangs: /health says
{"status": "starting"}, every other route a 503 error with Retry-After. No body is read.
"""
from __future__ import annotations

from starlette.responses import JSONResponse, Response

from moe_runtime.server.body_limit import declares_body
from moe_runtime.server.errors import APIError

STARTING_RETRY_AFTER_S = 5


class StartupGate:
    """An ASGI app answering 503 until `open(app)`; from then on, `app` answers everything."""

    def __init__(self) -> None:
        self.app = None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        response = starting_response(scope["path"], scope["method"])
        if declares_body(dict(scope["headers"])):
            response.headers["Connection"] = "close"   # the body is not read
        await response(scope, receive, send)


def starting_response(path: str, method: str) -> Response:
    if path == "/health":
        if method == "HEAD":
            return Response(status_code=503)
        return JSONResponse({"status": "starting"}, status_code=503)
    return APIError(503, "the server is starting: the engine is not ready yet", "service_unavailable", None,
                    "starting", retry_after_s=STARTING_RETRY_AFTER_S).response(path)
