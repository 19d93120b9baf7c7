"""The chat app in process over an engine that answers every request with a known script (reasoning and
harmony tests): each step gives one piece of text and its token ids, as the engine's front would."""
from __future__ import annotations

import asyncio

import httpx
import openai

from moe_runtime.records.outputs import RequestOutput
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.server import build_app
from server_harness import FakeEngine


class ScriptedChatEngine(FakeEngine):
    """Answers with `pieces` (text, token ids), one per step; records each request's prompt ids."""

    def __init__(self, tokenizer, pieces: list[tuple[str, list[int]]], finish_reason: str = "stop"):
        super().__init__(vocab_size=len(tokenizer))
        self.tokenizer = tokenizer   # the app renders chats with its template
        self.pieces = pieces
        self.finish_reason = finish_reason
        self.prompts: list[list[int]] = []
        self.stop_token_ids: list[list[int]] = []
        self.params: list = []   # every request's SamplingParams

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.prompts.append(list(prompt_token_ids))
        self.stop_token_ids.append(list(params.stop_token_ids))
        self.params.append(params)
        super().add_request(request_id, prompt_token_ids, params)

    def step(self) -> list[RequestOutput]:
        while self.waiting:
            self.running.append(self.waiting.popleft())
        outputs = []
        for request in list(self.running):
            text, ids = self.pieces[len(request.tokens)]
            request.tokens.append(len(request.tokens))
            finished = len(request.tokens) == len(self.pieces)
            if finished:
                self.running.remove(request)
            outputs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt, token_ids=list(request.tokens),
                text="".join(piece for piece, _ in self.pieces[:len(request.tokens)]), finished=finished,
                finish_reason=self.finish_reason if finished else None, new_token_ids=list(ids), new_text=text))
        return outputs


def text_pieces(pieces: list[str]) -> list[tuple[str, list[int]]]:
    """Text pieces with a dummy token each (readers of text only look at the text)."""
    return [(piece, [1]) for piece in pieces]


def run_chat(engine: ScriptedChatEngine, scenario, **app_kwargs):
    """`await scenario(AsyncOpenAI, httpx.AsyncClient)` against `build_app` on `engine` (one event loop)."""
    async def main():
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        transport = httpx.ASGITransport(app=build_app(async_engine, "scripted", **app_kwargs))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as http:
                client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
                return await scenario(client, http)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(asyncio.wait_for(main(), 60))
