"""HEAD answers on every GET route of the app `moe-serve` serves (the API, /metrics, /version, the dashboard,
/docs ...): the status GET would give, GET's headers, and no body. Load balancers and uptime checkers probe
with HEAD; a 405 there reads as "down".

The routes come from the app's own route table, so a GET route added later is held to this too.
"""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from server_harness import FakeEngine

from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.server import build_app
from moe_runtime.server.dashboard import dashboard_router

pytestmark = pytest.mark.timeout(60)

KEY = "K-head"
BEARER = {"Authorization": f"Bearer {KEY}"}
# a value for each path parameter: one that exists where it matters (the served model, a dashboard asset)
PATH_PARAMETERS = {"model_id": "fake", "name": "dashboard.js"}


def concrete(path: str) -> str:
    """`/v1/models/{model_id:path}` -> `/v1/models/fake`."""
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda match: PATH_PARAMETERS.get(match.group(1), "x"), path)


def get_paths(app) -> list[str]:
    """Every GET route's path, those of included routers too (FastAPI keeps them nested)."""
    return sorted({concrete(route.path) for route in iter_route_contexts(app.routes) if "GET" in (route.methods or ())})


def head_and_get(paths: list[str]) -> dict[str, dict[str, tuple[httpx.Response, httpx.Response]]]:
    """path -> {"key" / "no key": (GET's response, HEAD's response)}, on one app with an API key and the dashboard."""
    async def main():
        async_engine = AsyncEngine(FakeEngine()).start()
        app = build_app(async_engine, "fake", api_key=KEY, extra_routers=[dashboard_router(KEY)])
        assert set(get_paths(app)) == set(paths), "the app's GET routes changed: update the test's list"
        answers = {}
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=20) as client:
                for path in paths:
                    answers[path] = {}
                    for label, headers in (("key", BEARER), ("no key", {})):
                        answers[path][label] = (await client.get(path, headers=headers),
                                                await client.head(path, headers=headers))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        return answers

    return asyncio.run(asyncio.wait_for(main(), 50))


def app_get_paths() -> list[str]:
    return get_paths(build_app(AsyncEngine(FakeEngine()), "fake", api_key=KEY, extra_routers=[dashboard_router(KEY)]))


def test_every_get_route_answers_head_with_the_get_status_and_no_body():
    paths = app_get_paths()
    assert {"/v1/models", "/metrics", "/version", "/health", "/dashboard", "/v1/models/fake"} <= set(paths)
    answers = head_and_get(paths)
    for path, by_key in answers.items():
        for label, (got, head) in by_key.items():
            where = f"HEAD {path} ({label})"
            assert head.status_code != 405, where
            assert head.status_code == got.status_code, f"{where}: {head.status_code}, GET {got.status_code}"
            assert head.content == b"", where
            assert head.headers.get("content-type") == got.headers.get("content-type"), where
    answered = {path for path, by_key in answers.items() if by_key["key"][1].status_code == 200}
    assert {"/v1/models", "/metrics", "/version", "/health", "/dashboard", "/v1/models/fake", "/openapi.json"} \
        <= answered


def test_head_on_a_post_route_is_still_refused():
    async def main():
        async_engine = AsyncEngine(FakeEngine()).start()
        app = build_app(async_engine, "fake")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return await client.head("/v1/completions")
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    response = asyncio.run(asyncio.wait_for(main(), 30))
    assert response.status_code == 405 and response.content == b""
