"""The Messages API in process over a scripted engine (`scripted_chat`), with Anthropic's own client.

`anthropic` is built on httpx2 (not httpx): its client gets an httpx2 ASGI transport onto the same app that a
plain httpx client reaches, so a scenario can use both (the SDK for what clients see, httpx for raw events and
headers)."""
from __future__ import annotations

import asyncio
import dataclasses

import anthropic
import httpx
import httpx2

from moe_runtime.records.outputs import RequestOutput
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app
from scripted_chat import ScriptedChatEngine

MODEL = "scripted"


class ScriptedMessagesEngine(ScriptedChatEngine):
    """A `ScriptedChatEngine` whose last output can say which stop string ended it, and whose outputs say how many
    prompt tokens the prefix cache held (as the engine's front reports both)."""

    def __init__(self, tokenizer, pieces, finish_reason: str = "stop", stop_string: str | None = None,
                 cached_prompt_tokens: int = 0):
        super().__init__(tokenizer, pieces, finish_reason)
        self.stop_string = stop_string
        self.cached_prompt_tokens = cached_prompt_tokens

    def step(self) -> list[RequestOutput]:
        return [dataclasses.replace(output, cached_prompt_tokens=self.cached_prompt_tokens,
                                    stop_string=self.stop_string if output.finished else None)
                for output in super().step()]


def run_messages(engine: ScriptedChatEngine, scenario, client_key: str | None = "none",
                 client_headers: dict[str, str] | None = None, **app_kwargs):
    """`await scenario(AsyncAnthropic, httpx.AsyncClient)` against `build_app` on `engine` (one event loop).
    `client_key`: the SDK's api_key (it sends it as a Bearer token); None with `client_headers` sends only those
    (`{"x-api-key": ...}`, as Claude Code does)."""
    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        app = build_app(async_engine, MODEL, **app_kwargs)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=20) as http, \
                    httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test",
                                       timeout=20) as http2:
                headers = dict(client_headers or {})
                if client_key is None:   # whatever key the environment gives the SDK, it sends no Authorization
                    headers["Authorization"] = anthropic.omit
                client = anthropic.AsyncAnthropic(base_url="http://test", http_client=http2, max_retries=0,
                                                  api_key=client_key, default_headers=headers)
                return await scenario(client, http)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 60))
