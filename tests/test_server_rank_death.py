"""A worker rank of `moe-serve --ep 2` dies: /health turns 503, the in-flight stream ends with a 5xx
error (never a hang), the launcher exits with code 1 and leaves no process behind."""
import json
import os
import signal
import time

import httpx
import pytest

from process_tree import alive, descendants, rank_pids
from server_harness import ServerProcess

pytestmark = pytest.mark.slow


def test_killed_rank_fails_requests_and_the_launcher_exits_nonzero(tiny_checkpoint_factory):
    checkpoint = tiny_checkpoint_factory("mixtral")
    server = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "2", "--dp-attn", "2",
                            "--served-model-name", "tiny", "--log-level", "warning"]).start()
    try:
        pid = server.process.pid
        left_behind = descendants(pid)  # the fork server and the ranks
        workers = rank_pids(pid)
        assert len(workers) == 2, f"expected 2 ranks below {pid}'s fork server, found {workers}"
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "stream": True, "ignore_eos": True}
        events, failed_status = [], None
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    events.append(event)
                    if len(events) == 3:  # decoding is under way: kill the newest rank
                        os.kill(workers[1], signal.SIGKILL)
                    if "error" in event:
                        failed_status = event["error"].get("code")
                        break
            assert events and "error" in events[-1], f"the stream did not end with an error event: {events[-3:]}"
            assert str(failed_status).startswith("5") or events[-1]["error"]["type"], events[-1]
            health = http.get("/health")
            assert health.status_code == 503, health.text
        code = server.process.wait(30)
        assert code == 1, f"moe-serve exited with {code}:\n{server.tail()}"
        deadline = time.monotonic() + 10
        while any(alive(p) for p in left_behind) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in left_behind if alive(p)], "worker processes outlived the launcher"
    finally:
        server.stop()
