"""Bearer API-key check for the /v1 routes (health and metrics stay open, as in vLLM)."""
from __future__ import annotations

import secrets

from fastapi import Request

from server.errors import APIError


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency that raises 401 unless `Authorization: Bearer <api_key>`; a no-op without a key."""

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key")

    return require_api_key
