"""The API key: one rule for every route but /health and /metrics (probes and scrapers stay open).

`ApiKeyGate` is a pure ASGI middleware: it decides from the request headers alone, before a byte of
the body is read, so a client without the key cannot make the server read, parse or tokenize
anything. The key comes as `Authorization: Bearer <key>` (API clients) or as the password of
`Authorization: Basic` (any user name): a browser opening /dashboard or /docs gets a Basic challenge,
asks its user for the key once, and then sends it with every request of the page by itself.
"""
from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass

from fastapi import Request

from server.body_limit import declares_body
from server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})
BROWSER_REALM = 'Basic realm="moe-serve", charset="UTF-8"'


def presented_key(authorization: str) -> str | None:
    """The key an `Authorization` header carries (Bearer token, or Basic password); None if it carries none."""
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _user, separator, password = decoded.partition(":")
        return password if separator else None
    return None


def key_matches(authorization: str, api_key: str) -> bool:
    presented = presented_key(authorization)
    return presented is not None and secrets.compare_digest(presented.encode(), api_key.encode())


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                    None, "invalid_api_key")


@dataclass
class ApiKeyGate:
    """ASGI middleware: 401 for every HTTP request without the key, except on `OPEN_PATHS`."""

    app: object
    api_key: str | None

    async def __call__(self, scope, receive, send) -> None:
        if self.api_key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if key_matches(authorization, self.api_key):
            await self.app(scope, receive, send)
            return
        extra = {"WWW-Authenticate": BROWSER_REALM if not scope["path"].startswith("/v1/") else "Bearer"}
        if declares_body(headers):
            extra["Connection"] = "close"
        response = unauthorized().response()
        response.headers.update(extra)
        await response(scope, receive, send)


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency that raises 401 without the key (a no-op without one), for routers used on their own.

    An app from `build_app(api_key=...)` already checks every route in `ApiKeyGate`; this guards a
    router (the dashboard's rebalance) even in an app built without that key.
    """

    async def require_api_key(request: Request) -> None:
        if api_key is not None and not key_matches(request.headers.get("authorization", ""), api_key):
            raise unauthorized()

    return require_api_key
