"""HEAD on every GET route: the GET's status and headers, no body (RFC 9110, section 9.3.2).

FastAPI routes answer only the methods they name, so `@app.get` gives HEAD a 405, and load balancers and
uptime checkers probe with HEAD. One middleware serves every GET route, those added later and the
dashboard's included: HEAD runs as GET, and the body is dropped. A route that is not GET still refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class HeadAsGet:
    """ASGI middleware: a HEAD request is answered as GET without its body.

    The scope is copied, not changed: the server's own copy still says HEAD, so it writes no body either
    (uvicorn leaves a HEAD's body out itself). Once the headers are sent the response is complete: a body
    that streams on (an event stream) is told the client left, so it stops.
    """

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        answered = False

        async def receive_until_answered() -> Message:
            if answered:
                return {"type": "http.disconnect"}
            return await receive()

        async def send_headers_only(message: Message) -> None:
            nonlocal answered
            if answered:
                return
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body":
                answered = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)

        await self.app({**scope, "method": "GET"}, receive_until_answered, send_headers_only)
