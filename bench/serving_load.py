"""The load side of bench_serving: a `moe-serve` subprocess and a closed loop of streaming clients.

`Server` starts `moe-serve` from a checkout (port 0) and reads the URL it listens on; `run_level`
sends a list of prompts through N concurrent streaming clients (each sends its next request when
the previous one ends) and returns one `RequestRecord` per request (when each chunk arrived, how
many tokens); `summarize` turns a level's records into a `LevelResult` (throughput, TTFT, ITL,
TPOT). `make_prompts` builds the mixed-length token prompts every level uses.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"moe-serve: serving .* on (http://[^\s]+)")
PROMPT_LENGTHS = (16, 48, 128, 320)  # cycled: a mix of short chat turns and longer documents

CHAT_MODE = "_chat"   # a key of a run's extra body: send it to /v1/chat/completions (removed before sending)


@dataclass
class RequestRecord:
    prompt_len: int
    start: float
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class LevelResult:
    name: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    throughput_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(name: str, concurrency: int, records: list[RequestRecord], duration_s: float) -> LevelResult:
    ok = [r for r in records if r.error is None and r.first_token is not None]
    tokens = sum(r.completion_tokens for r in ok)
    gaps = [g for r in ok for g in r.gaps()]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return LevelResult(
        name=name, concurrency=concurrency, requests=len(records), failed=len(records) - len(ok),
        duration_s=duration_s, output_tokens=tokens, throughput_tok_s=tokens / duration_s,
        ttft_p50_ms=1e3 * percentile([r.ttft for r in ok], 50), ttft_p99_ms=1e3 * percentile([r.ttft for r in ok], 99),
        itl_p50_ms=1e3 * percentile(gaps, 50), itl_p99_ms=1e3 * percentile(gaps, 99),
        tpot_mean_ms=1e3 * float(np.mean(tpots)) if tpots else float("nan"),
    )


def make_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])]
            for i in range(count)]

# ---- the server -----------------------------------------------------------------------------

def cli_module(tree: Path) -> str:
    """The moe-serve module of a checkout (it moved from the engine package to server/, then to moe_runtime/server/)."""
    if (tree / "moe_runtime" / "server" / "cli.py").exists():
        return "moe_runtime.server.cli"
    return "server.cli" if (tree / "server" / "cli.py").exists() else "moe_runtime.cli"


class Server:
    def __init__(self, model: str, device: str, max_num_seqs: int, threads: int | None, timeout_s: float = 300.0,
                 tree: Path = REPO_ROOT, extra_args: tuple[str, ...] = ()):
        command = [sys.executable, "-m", cli_module(tree), "--model", model, "--device", device, "--port", "0",
                   "--max-num-seqs", str(max_num_seqs), "--max-queue", "4096", "--log-level", "warning",
                   *extra_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=tree)
        self.url = None
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.process.stdout:
                self.lines.append(line)
                match = LISTENING.search(line)
                if match:
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moe-serve did not start:\n" + "".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def stream_one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                     extra_body: dict | None = None) -> RequestRecord:
    """One streamed request; `extra_body` with CHAT_MODE set sends the prompt as a chat message instead."""
    record = RequestRecord(len(prompt), time.perf_counter())
    extra = dict(extra_body or {})
    chat = extra.pop(CHAT_MODE, False)
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}
    if chat:  # a distinct user message per prompt, so no two requests share more than the template's prefix
        body["messages"] = [{"role": "user", "content": "Record these readings: " + " ".join(map(str, prompt))}]
    else:
        body["prompt"] = prompt
    try:
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and _has_new_output(chunk["choices"][0]):
                    if record.first_token is None:
                        record.first_token = now
                    record.chunk_times.append(now)
    except httpx.HTTPError as exc:
        record.error = repr(exc)
    record.end = time.perf_counter()
    return record


def _has_new_output(choice: dict) -> bool:
    if "delta" in choice:  # chat: text or a tool call's name / argument fragment
        return bool(choice["delta"].get("content") or choice["delta"].get("tool_calls"))
    return bool(choice["text"])


async def run_level(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    extra_body: dict | None = None) -> tuple[list, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[RequestRecord] = []

    async def client_loop(client):
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await stream_one(client, prompt, max_tokens, extra_body))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return records, time.perf_counter() - start
