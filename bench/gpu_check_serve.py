"""gpu_check part `serve`: `moe-serve --device <the run's device>` on the demo model answers a completion.

Started as tests/server_harness.py's `ServerProcess` does (`python -m server.cli`, the module behind
the `moe-serve` console script, on a free loopback port, waiting for /health): on a machine where the
project is not pip-installed the entry point is not on PATH, the module always is. The server's log
says which kernel family it chose; on CUDA that must be Triton.
"""
from __future__ import annotations

import re
import time

import httpx

from gpu_check_mode import RunMode
from gpu_check_outcome import Outcome, judged
from server_harness import ServerProcess

STARTUP_TIMEOUT_S = 90.0          # the first start also builds the demo model
MAX_TOKENS = 16
KERNEL_CHOICE = re.compile(r"MoE kernels: (\w+) on (\S+)")


class ServePart:
    def __init__(self, mode: RunMode):
        self.mode = mode

    def check_names(self) -> list[str]:
        return ["demo_completion"]

    def close(self) -> None:
        pass

    def run(self, name: str) -> Outcome:
        started = time.perf_counter()
        server = ServerProcess(["--device", self.mode.device, "--log-level", "info"],
                               startup_timeout_s=STARTUP_TIMEOUT_S)
        with server:
            ready_s = time.perf_counter() - started
            models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
            model = models["data"][0]["id"]
            asked = time.perf_counter()
            reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0.0})
            latency_s = time.perf_counter() - asked
        exit_code = server.process.returncode if server.process else None
        log = list(server.log)
        choice = KERNEL_CHOICE.search("\n".join(log))
        problems = []
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        if reply.status_code != 200:
            problems.append(f"/v1/completions answered {reply.status_code}: {reply.text[:300]}")
        else:
            text = body["choices"][0]["text"]
            completion_tokens = body.get("usage", {}).get("completion_tokens", 0)
            if not isinstance(text, str) or not 1 <= completion_tokens <= MAX_TOKENS:
                problems.append(f"odd completion: text {text!r}, {completion_tokens} tokens")
        kernels = choice.group(1) if choice else None
        if self.mode.device == "cuda" and kernels != "triton":
            problems.append(f"the server ran the {kernels or 'unknown'} kernel family on CUDA, not triton")
        if exit_code not in (0, None):
            problems.append(f"moe-serve exited with {exit_code} on SIGTERM")
        return judged(problems, device=self.mode.device, model=model, status=reply.status_code,
                      reply=body, kernels=kernels, kernel_device=choice.group(2) if choice else None,
                      ready_s=ready_s, latency_s=latency_s, exit_code=exit_code, log_tail=log[-25:])


def build_part(mode: RunMode) -> ServePart:
    return ServePart(mode)
