"""A decode instance's SSE stream relayed to the router's client, byte for byte.

An async iterator rather than an async generator so that closing it always closes the instance's
connection, also when the client left before the first byte was relayed (a generator that never
started runs no clean-up). Closing the connection is what makes the instance abort the request and
free its KV blocks. If the instance breaks the stream (it died), the client gets one clean SSE
error event and the stream ends.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

import httpx

from moe_runtime.server.errors import APIError
from moe_runtime.server.pd_router.backends import Backend
from moe_runtime.server.sse import sse_data

logger = logging.getLogger(__name__)


class RelayedStream:
    def __init__(self, backend: Backend, upstream: httpx.Response, on_broken: Callable[[Backend, str], None]):
        """`backend` counts this stream in flight until it is closed; `on_broken(backend, detail)` when it fails."""
        self.backend = backend
        self.upstream = upstream
        self.on_broken = on_broken
        self._chunks: AsyncIterator[bytes] = upstream.aiter_raw()
        self._ended = False
        self._closed = False

    def __aiter__(self) -> "RelayedStream":
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended = True
            self.backend.served += 1
            raise
        except httpx.HTTPError as exc:   # the decode instance died under the stream
            self._ended = True
            self.on_broken(self.backend, f"{type(exc).__name__}: {exc}")
            logger.warning("decode instance %s broke a stream: %s", self.backend.url, exc)
            return sse_data(APIError(502, f"the decode instance {self.backend.url} failed",
                                     "decode_failed").body()).encode()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.in_flight -= 1
        await self.upstream.aclose()
