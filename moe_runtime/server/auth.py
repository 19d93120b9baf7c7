"""The API key: one rule for every route but /health and /metrics (probes and scrapers stay open).

`ApiKeyGate` is a pure ASGI middleware: it decides from the request headers alone, before a byte of
the body is read, so a client without the key cannot make the server read, parse or tokenize
anything. The key comes as `Authorization: Bearer <key>` (API clients), as the password of
`Authorization: Basic` (any user name): a browser opening /dashboard or /docs gets a Basic challenge,
asks its user for the key once, and then sends it with every request of the page by itself; or as
`x-api-key: <key>`, Anthropic's header (Claude Code and Anthropic's SDKs send the key that way), on every
route alike. A request presents one key: its Authorization header's when that carries one, else its
x-api-key (`request_key`).

Several keys (one per tenant) may be given: any of them opens the routes, and the gate records which one
a request presented (its index, `KEY_INDEX_STATE` in the request's state) so that the app can keep the
tenants' prefix caches apart (`server.tenant_salt`). The raw key goes no further than this module.
"""
from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass, field
from typing import Sequence

from fastapi import Request

from moe_runtime.server.admin_routes import ADMIN_PATHS, AdminKey
from moe_runtime.server.body_limit import declares_body
from moe_runtime.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})
BROWSER_REALM = 'Basic realm="moe-serve", charset="UTF-8"'
KEY_INDEX_STATE = "api_key_index"   # request.state's name for the index of the key the request presented


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


def request_key(authorization: str, x_api_key: str | None) -> str | None:
    """The key a request presents: its `Authorization` header's (Bearer token, Basic password) if that carries one,
    else its `x-api-key` header's; None if it presents none."""
    presented = presented_key(authorization)
    if presented is not None:
        return presented
    if x_api_key is None or not x_api_key.strip():
        return None
    return x_api_key.strip()


def key_in_headers(headers: dict[bytes, bytes]) -> str | None:
    """`request_key` of an ASGI scope's headers (names lowercased, as ASGI gives them)."""
    x_api_key = headers.get(b"x-api-key")
    return request_key(headers.get(b"authorization", b"").decode("latin-1"),
                       x_api_key.decode("latin-1") if x_api_key is not None else None)


def key_matches(authorization: str, api_key: str) -> bool:
    presented = presented_key(authorization)
    return presented is not None and secrets.compare_digest(presented.encode(), api_key.encode())


@dataclass(frozen=True)
class ApiKeys:
    """The keys the server accepts; a request's key identity is the index of the key it presented."""

    keys: tuple[str, ...]

    @classmethod
    def of(cls, api_key: str | Sequence[str] | None) -> "ApiKeys | None":
        """None without a key; one key (a string) or several."""
        if api_key is None:
            return None
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
        if not keys:
            raise ValueError("api_key: give at least one key (or None for none)")
        if len(set(keys)) != len(keys):
            raise ValueError("api_key: the same key is given twice (each tenant needs a key of its own)")
        return cls(keys)

    @property
    def several(self) -> bool:
        return len(self.keys) > 1

    def identify(self, presented: str | None) -> int | None:
        """The index of the key a request presented (`request_key`); None if it is none of them. Every
        key is compared, in constant time each, so the time taken does not tell which key matched."""
        if presented is None:
            return None
        matches = [secrets.compare_digest(presented.encode(), key.encode()) for key in self.keys]
        return matches.index(True) if any(matches) else None


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    "authentication_error", None, "invalid_api_key")


def admission(keys: ApiKeys | None, admin: AdminKey, presented: str | None,
              admin_route: bool) -> tuple[int | None, APIError | None]:
    """(the tenant key's index, None) for a request that may go on, (None, the refusal) for one that may not: a
    tenant key or the admin key where keys are set, and on an admin route `server.admin_routes`' rule.
    `presented`: the key the request presented (`request_key`)."""
    key_index = keys.identify(presented) if keys is not None else None
    if keys is not None and key_index is None and not admin.matches(presented):
        return None, unauthorized()
    if admin_route:
        refusal = admin.refusal(keys is not None and keys.several, presented)
        if refusal is not None:
            return None, refusal
    return key_index, None


@dataclass
class ApiKeyGate:
    """ASGI middleware: 401 for every HTTP request without a key, except on `OPEN_PATHS`; a request that
    presents one has the key's index in its state (`KEY_INDEX_STATE`). Admin routes (`server.admin_routes`)
    need the admin key where one is set, and are refused to every tenant key where several are served."""

    app: object
    api_key: str | Sequence[str] | None
    admin_key: str | None = None
    keys: ApiKeys | None = field(init=False)
    admin: AdminKey = field(init=False)

    def __post_init__(self) -> None:
        self.keys = ApiKeys.of(self.api_key)
        self.admin = AdminKey(self.admin_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or (self.keys is None and self.admin.key is None):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        key_index, refusal = admission(self.keys, self.admin, key_in_headers(headers), scope["path"] in ADMIN_PATHS)
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send, headers)
            return
        if key_index is not None:
            scope.setdefault("state", {})[KEY_INDEX_STATE] = key_index
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(error: APIError, scope, receive, send, headers: dict) -> None:
        extra = {}
        if error.status == 401:
            extra["WWW-Authenticate"] = BROWSER_REALM if not scope["path"].startswith("/v1/") else "Bearer"
        if declares_body(headers):
            extra["Connection"] = "close"
        response = error.response(scope["path"])   # in the shape of the API the path belongs to
        response.headers.update(extra)
        await response(scope, receive, send)


def api_key_dependency(api_key: str | Sequence[str] | None, admin_key: str | None = None, admin: bool = False):
    """A FastAPI dependency that raises 401 without the key (a no-op without one), for routers used on their own;
    `admin`: the route is an admin route, under `server.admin_routes`' rule.

    An app from `build_app(api_key=...)` already checks every route in `ApiKeyGate`; this guards a
    router (the dashboard's rebalance) even in an app built without that key.
    """

    keys = ApiKeys.of(api_key)
    admin_rule = AdminKey(admin_key)

    async def require_api_key(request: Request) -> None:
        presented = request_key(request.headers.get("authorization", ""), request.headers.get("x-api-key"))
        _, refusal = admission(keys, admin_rule, presented, admin)
        if refusal is not None:
            raise refusal

    return require_api_key
