"""docs/design.md's *A request and a step, file by file* names every project file whose code runs for a request
and for a decode step: this follows a real one with a profiler and compares.

One rank in this process, a tiny Qwen3-MoE on the CPU, the server app in process (httpx over ASGI), a warm-up
request then the traced one: a non-streamed `/v1/completions`, greedy, 4 tokens. Every Python call into a
`moe_runtime` file counts, on every thread (the loop, the conversion worker, the engine-core thread); the calls
inside `EngineCore.schedule` and `execute` are the steps', and the last step (a decode) is the decode step's list.
A file that runs and is not listed, or is listed and does not run, fails the test with its name.

The section also names each one's *path*: the files that hand it along, each calling the next, without the leaves
they call on the way (gates, counters, checks). A path is the project files on the call stack at its hand-offs
(`REQUEST_HANDOFFS`, `STEP_HANDOFFS`), read from the same traced run: each stack from its root down (the route
handler on the loop, the core thread's or a loop callback's first frame, `EngineCore.schedule` / `execute` for a
step), the files in the order they first appear, hand-off after hand-off. The lists written there must be these.
"""
from __future__ import annotations

import asyncio
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.server import build_app

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent
PACKAGE = str(REPO / "moe_runtime") + "/"
SECTION = "## A request and a step, file by file"
STEP_LIST = "A decode step, on every rank"
STEP_CALLS = {("engine/core.py", "schedule"), ("engine/core.py", "execute")}
REQUEST_PATH = "**A request's path: "
STEP_PATH = "**A decode step's path: "
# Where a request is handed on, in order: the way in, then the way back (token ids to the response's text).
REQUEST_HANDOFFS = [
    ("front/inprocess_client.py", "send"),            # the loop sends the AddRequest to the core
    ("engine/scheduler.py", "add"),                   # the core thread applies it: the request enters the scheduler
    ("attention_dp/core_commands.py", "report_step"),  # a step's token ids leave the core (StepOutputs)
    ("front/detokenizer.py", "increment"),            # the front's output processing: token ids to text
    ("front/async_engine.py", "_put"),                # the output on the request's stream
    ("server/deltas.py", "advance"),                  # the route reads it: what the choice adds
    ("server/completions.py", "response"),            # the API's response built
]
# The deepest points of a step: where the batch is chosen, then the kernels and the draw.
STEP_HANDOFFS = [
    ("engine/scheduler.py", "schedule"),
    ("kernels/paged_attention.py", "paged_decode_attention"),
    ("kernels/expert_mlp.py", "expert_mlp"),
    ("sampling/sampler.py", "draw"),
]
HANDOFFS = set(REQUEST_HANDOFFS) | set(STEP_HANDOFFS)
# A stack is read from the hand-off down to the first of these (kept); a stack without one goes to its bottom.
STACK_ROOTS = {("server/app.py", "completions"), ("engine/core.py", "schedule"), ("engine/core.py", "execute")}


class CallTrace:
    """The `moe_runtime` files called while `on`, split into the request's and each step's (per thread)."""

    def __init__(self):
        self.on = False
        self.request: set[str] = set()
        self.steps: list[set[str]] = []
        self.request_stacks: dict[tuple[str, str], list[str]] = {}
        self.step_stacks: list[dict[tuple[str, str], list[str]]] = []   # per step
        self._depth = threading.local()

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event not in ("call", "return"):
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE):
            return
        where = filename[len(PACKAGE):]
        depth = getattr(self._depth, "value", 0)
        if (where, frame.f_code.co_name) in STEP_CALLS:
            if event == "call" and frame.f_code.co_name == "schedule":
                self.steps.append(set())
                self.step_stacks.append({})
            self._depth.value = depth + (1 if event == "call" else -1)
            depth = max(depth, self._depth.value)
        if event != "call":
            return
        (self.steps[-1] if depth > 0 else self.request).add("moe_runtime/" + where)
        call = (where, frame.f_code.co_name)
        stacks = self.step_stacks[-1] if depth > 0 else self.request_stacks
        if call in HANDOFFS and call not in stacks:
            stacks[call] = project_stack(frame)


def project_stack(frame) -> list[str]:
    """The `moe_runtime` files on the stack, root first: from the nearest `STACK_ROOTS` frame (else the bottom)
    up to `frame`."""
    files = []
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE):
            where = filename[len(PACKAGE):]
            files.append("moe_runtime/" + where)
            if (where, frame.f_code.co_name) in STACK_ROOTS:
                break
        frame = frame.f_back
    return files[::-1]


def spine(stacks: dict[tuple[str, str], list[str]], handoffs: list[tuple[str, str]]) -> list[str]:
    """The files of the hand-offs' stacks, each once, in the order they first appear."""
    missing = [call for call in handoffs if call not in stacks]
    assert not missing, f"these hand-offs did not run: {missing}"
    return list(dict.fromkeys(path for call in handoffs for path in stacks[call]))


def documented() -> tuple[set[str], set[str]]:
    text = (REPO / "docs" / "design.md").read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start + len(SECTION))]
    listed = re.compile(r"^\d+\. .*?(?=^\d+\. |^\S|\Z)", re.S | re.M)
    request_part, step_part = section.split(STEP_LIST)

    def files(part: str) -> set[str]:
        return {path for item in listed.findall(part) for path in re.findall(r"`(moe_runtime/[\w/]+\.py)`", item)}
    return files(request_part), files(step_part)


def documented_path(heading: str) -> list[str]:
    """The files a path's paragraph names, in order; its heading's count must be theirs."""
    text = (REPO / "docs" / "design.md").read_text()
    start = text.index(heading)
    paragraph = text[start:text.index("\n\n", start)]
    count = int(re.match(r"\d+", paragraph[len(heading):]).group())
    paths = re.findall(r"`(moe_runtime/[\w/]+\.py)`", paragraph)
    assert count == len(paths), f"design.md's {heading!r} says {count} files and names {len(paths)}"
    return paths


@pytest.fixture(scope="module")
def traced(tiny_checkpoint_factory):
    trace = CallTrace()
    threading.setprofile(trace)   # before the engine: its core thread and the conversion threads start traced
    try:
        engine = make_engine(EngineConfig(model=str(tiny_checkpoint_factory("qwen3_moe")), max_model_len=256))
        async_engine = AsyncEngine(engine, AsyncEngineConfig()).start()
        app = build_app(async_engine, "tiny")
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as client:
                warm = await client.post("/v1/completions", json=body)
                assert warm.status_code == 200, warm.text
                trace.on = True
                sys.setprofile(trace)
                try:
                    answer = await client.post("/v1/completions", json=body)
                finally:
                    sys.setprofile(None)
                    trace.on = False
                assert answer.status_code == 200, answer.text
                return answer.json()

        try:
            answer = asyncio.run(main())
        finally:
            async_engine.shutdown()
    finally:
        threading.setprofile(None)
    assert answer["choices"][0]["finish_reason"] == "length"
    return trace


def test_the_request_path_lists_every_file_that_runs(traced):
    listed, _ = documented()
    assert not traced.request - listed, f"ran for the request, not in design.md: {sorted(traced.request - listed)}"
    assert not listed - traced.request, f"in design.md's request path, did not run: {sorted(listed - traced.request)}"


def test_the_decode_step_lists_every_file_that_runs(traced):
    _, listed = documented()
    assert len(traced.steps) == 4, "a prefill then three decode steps"
    decode = traced.steps[-1]
    assert not decode - listed, f"ran in the decode step, not in design.md: {sorted(decode - listed)}"
    assert not listed - decode, f"in design.md's decode step, did not run: {sorted(listed - decode)}"


def test_the_request_path_is_the_files_at_its_hand_offs(traced):
    traced_path = spine(traced.request_stacks, REQUEST_HANDOFFS)
    assert documented_path(REQUEST_PATH) == traced_path, f"traced: {traced_path}"


def test_the_decode_step_path_is_the_files_at_its_deepest_calls(traced):
    traced_path = spine(traced.step_stacks[-1], STEP_HANDOFFS)
    assert documented_path(STEP_PATH) == traced_path, f"traced: {traced_path}"
