"""One client request through the router: the prompt on a prefill instance, the rest on a decode instance.

1. The prefill half: the request as the client sent it, not streamed, with
   `kv_transfer_params: {"do_remote_decode": true}`. The instance validates it as the whole request
   (its refusal, a 400, goes back to the client as it is: before any prefill), runs the prompt and
   its first token, and answers with the handle of the parked KV. If that first token ended the
   request (EOS, a stop, no room for more) the answer has no handle: it is the client's answer
   (`final_answer`), nothing runs twice.
2. The decode half: the request as the client sent it, with that handle as `kv_transfer_params`.
   Its answer (an SSE stream relayed byte for byte, or a JSON body) is the client's.

`kv_transfer_params` from a client is refused: only the router's own prefill answer supplies one
(a handle is good for one request, and a client has no business choosing what a decode instance
pulls). A request the split does not fit (several choices, echo, prompt logprobs, max_tokens below
2) goes whole to a decode instance (a full engine), and so does every request while no prefill
instance can take it (none usable, or the chosen one unreachable). A client that leaves cancels
whichever half is running; the instance sees its connection close and aborts (KV blocks freed on
both sides: the decode instance releases the prefill's copy). An instance that fails (no
connection, a broken stream) fails the requests it was serving with a clean error and is left out
until its /health answers again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moe_runtime.server.errors import APIError
from moe_runtime.server.json_body import too_deep, too_long_integer
from moe_runtime.server.pd_router.backends import Backend, BackendPool, NoBackend
from moe_runtime.server.pd_router.final_answer import final_body, final_events
from moe_runtime.server.pd_router.metrics import RouterMetrics
from moe_runtime.server.pd_router.relay import RelayedStream
from moe_runtime.server.sse import EventStreamResponse

logger = logging.getLogger(__name__)

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
KV_TRANSFER_PARAM = "kv_transfer_params"
PREFILL_UNREACHABLE = object()   # `_prefill`'s answer when its instance could not be reached


@dataclass(frozen=True)
class Split:
    """How the router serves one request."""

    disaggregated: bool
    stream: bool


def split_of(route: str, body: dict) -> Split:
    stream = body.get("stream") is True
    if body.get("n", 1) != 1:
        return Split(False, stream)
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
            return Split(False, stream)      # several prompts: several choices
        if body.get("echo") or body.get("prompt_logprobs") is not None:
            return Split(False, stream)
        max_tokens = body.get("max_tokens", 16)
    else:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        return Split(False, stream)
    return Split(True, stream)


def prefill_body(body: dict) -> dict:
    """The prefill half: the client's request (its max_tokens too: the instance validates the whole
    request, then runs one token), not streamed, asking for a handle."""
    half = {name: value for name, value in body.items() if name != "stream_options"}
    half.update(stream=False, kv_transfer_params={"do_remote_decode": True})
    return half


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return APIError(status, message, kind, param).response()


class Forwarder:
    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics,
                 backend_api_key: str | None):
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}

    async def forward(self, route: str, body: dict, request: Request) -> Response:
        if KV_TRANSFER_PARAM in body:
            self.metrics.count("refused")
            return error_response(400, f"{KV_TRANSFER_PARAM}: set by the router between its prefill and decode "
                                       f"instances, not by clients", "invalid_request_error", KV_TRANSFER_PARAM)
        split = split_of(route, body)
        if not split.disaggregated:
            self.metrics.count("decode_only")
            return await self._decode(route, body, split.stream, request)
        try:
            prefill = self.pool.choose("prefill")
        except NoBackend as exc:   # a decode instance is a full engine: it serves the request whole
            logger.debug("%s; serving a request whole on a decode instance", exc)
            self.metrics.count("prefill_fallback")
            return await self._decode(route, body, split.stream, request)
        answer = await self._until_disconnect(request, self._prefill(prefill, route, body))
        if answer is None:
            self.metrics.count("aborted")
            return error_response(499, "the client closed the request", "aborted")
        if answer is PREFILL_UNREACHABLE:
            self.metrics.count("prefill_fallback")
            return await self._decode(route, body, split.stream, request)
        if isinstance(answer, Response):
            return answer
        handle = answer.get(KV_TRANSFER_PARAM)
        if handle is None:   # its first token ended it: the prefill's answer is the whole answer
            self.metrics.count("prefill_only")
            if split.stream:
                return Response(b"".join(final_events(route, answer, body)), media_type="text/event-stream")
            return JSONResponse(final_body(answer))
        self.metrics.count("disaggregated")
        return await self._decode(route, {**body, KV_TRANSFER_PARAM: handle}, split.stream, request)

    async def _prefill(self, backend: Backend, route: str, body: dict) -> dict | Response | object:
        """The prefill instance's JSON answer, the response to send the client instead (its refusal, or a
        clean error when it failed), or PREFILL_UNREACHABLE (no connection: the request never ran)."""
        started = time.perf_counter()
        backend.in_flight += 1
        try:
            response = await self.client.post(backend.url + ROUTES[route], json=prefill_body(body),
                                              headers=self.headers)
        except httpx.HTTPError as exc:
            self.pool.mark_failed(backend, f"{type(exc).__name__}: {exc}")
            logger.warning("prefill instance %s failed a request: %s", backend.url, exc)
            if isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException):
                return PREFILL_UNREACHABLE   # gone (refused, reset): nothing ran for the client; serve it whole
            self.metrics.count("prefill_failed")
            return error_response(502, f"the prefill instance {backend.url} failed: {type(exc).__name__}",
                                  "prefill_failed")
        finally:
            backend.in_flight -= 1
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        if response.status_code != 200:
            self.metrics.count("refused" if response.status_code < 500 else "prefill_failed")
            return Response(response.content, response.status_code, media_type="application/json")
        backend.served += 1
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self.metrics.count("prefill_failed")
            return error_response(502, f"the prefill instance {backend.url} answered garbage", "prefill_failed")
        return answer

    async def _decode(self, route: str, body: dict, stream: bool, request: Request) -> Response:
        try:
            backend = self.pool.choose("decode")
        except NoBackend as exc:
            self.metrics.count("no_instance")
            return error_response(503, str(exc), "service_unavailable")
        url = backend.url + ROUTES[route]
        if not stream:
            backend.in_flight += 1
            try:
                response = await self._until_disconnect(
                    request, self.client.post(url, json=body, headers=self.headers))
            except httpx.HTTPError as exc:
                return self._decode_failed(backend, exc)
            finally:
                backend.in_flight -= 1
            if response is None:
                self.metrics.count("aborted")
                return error_response(499, "the client closed the request", "aborted")
            backend.served += 1
            return Response(response.content, response.status_code, media_type="application/json")
        backend.in_flight += 1
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, json=body, headers=self.headers),
                                              stream=True)
        except httpx.HTTPError as exc:
            backend.in_flight -= 1
            return self._decode_failed(backend, exc)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            backend.in_flight -= 1
            return Response(content, upstream.status_code, media_type="application/json")
        return EventStreamResponse(RelayedStream(backend, upstream, self._stream_broken))

    def _stream_broken(self, backend: Backend, detail: str) -> None:
        self.pool.mark_failed(backend, detail)
        self.metrics.count("decode_failed")

    def _decode_failed(self, backend: Backend, exc: httpx.HTTPError) -> Response:
        self.pool.mark_failed(backend, f"{type(exc).__name__}: {exc}")
        self.metrics.count("decode_failed")
        logger.warning("decode instance %s failed a request: %s", backend.url, exc)
        return error_response(502, f"the decode instance {backend.url} failed: {type(exc).__name__}", "decode_failed")

    @staticmethod
    async def _until_disconnect(request: Request, work):
        """`await work`, unless the client disconnects first: then it is cancelled (None is returned), which
        closes the instance's connection, and the instance aborts the request."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        return None


async def wait_for_disconnect(request: Request) -> None:
    """The body has been read: the next ASGI message of this request is its disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:   # nested past the parser's limit: name the field, as an instance would
        raise too_deep(raw) from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the body is not JSON: {exc}", "invalid_request_error") from exc
    except ValueError:       # an integer literal longer than Python converts
        raise too_long_integer(raw) from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_request_error")
    return body
