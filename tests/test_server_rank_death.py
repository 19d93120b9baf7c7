"""A worker rank of `moe-serve` dies. By default the ranks restart and every stream goes on to the end it would
have had, /health back to 200; with `--max-rank-restarts 0` /health turns 503, the in-flight stream ends with a
5xx error (never a hang), the launcher exits with code 1 and leaves no process behind."""
import json
import os
import signal
import threading
import time

import httpx
import pytest

from process_tree import alive, descendants, rank_pids
from server_harness import ServerProcess

pytestmark = pytest.mark.slow


def test_killed_rank_fails_requests_and_the_launcher_exits_nonzero(tiny_checkpoint_factory):
    checkpoint = tiny_checkpoint_factory("mixtral")
    server = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "2", "--dp-attn", "2",
                            "--served-model-name", "tiny", "--log-level", "warning", "--max-rank-restarts", "0"]).start()
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


def _stream(http, body: dict, events: list, first_tokens: threading.Event | None = None) -> None:
    """One streaming completion; its events in `events` (the thread's result)."""
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
                if first_tokens is not None and len(events) >= 4:
                    first_tokens.set()
            elif line == "data: [DONE]":
                events.append("[DONE]")


def test_the_others_re_form_without_a_killed_rank_and_every_stream_ends_as_it_would_have(tiny_checkpoint_factory):
    """moe-serve --ep 4 --dp-attn 4 --num-redundant-experts 4, 8 greedy streams in flight, one rank SIGKILLed:
    the server stays up, all 8 streams end normally with the text they had before the kill, /health answers
    200 throughout ("degraded" while they re-form, "ok" again within 60 s), and the three others go on in their
    processes (keeping their weights) with a fresh process in the lost rank's place."""
    checkpoint = tiny_checkpoint_factory("mixtral")
    server = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "4", "--dp-attn", "4",
                            "--num-redundant-experts", "4", "--served-model-name", "tiny",
                            "--log-level", "warning"]).start()
    try:
        workers = rank_pids(server.process.pid)
        assert len(workers) == 4, workers
        bodies = [{"model": "tiny", "prompt": [5 + i, 6, 7, 8 + i], "max_tokens": 32, "temperature": 0,
                   "stream": True, "ignore_eos": True} for i in range(8)]
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            batched = http.post("/v1/completions", json={**bodies[0], "stream": False,
                                                         "prompt": [b["prompt"] for b in bodies]}).json()
            before = [choice["text"] for choice in sorted(batched["choices"], key=lambda c: c["index"])]
            results = [[] for _ in bodies]
            started = threading.Event()
            threads = [threading.Thread(target=_stream, args=(http, b, r, started if i == 0 else None))
                       for i, (b, r) in enumerate(zip(bodies, results))]
            for thread in threads:
                thread.start()
            assert started.wait(60), "the streams did not start"
            os.kill(workers[2], signal.SIGKILL)
            killed_at = time.monotonic()
            statuses = set()
            while any(thread.is_alive() for thread in threads) and time.monotonic() - killed_at < 120:
                health = http.get("/health")   # 200 throughout: "degraded" while the ranks restart
                statuses.add((health.status_code, health.json()["status"]))
                time.sleep(0.05)
            for thread in threads:
                thread.join(max(120 - (time.monotonic() - killed_at), 0.1))
            assert not any(thread.is_alive() for thread in threads), f"streams still open:\n{server.tail()}"
            for events, text in zip(results, before):
                assert events and events[-1] == "[DONE]", f"{events[-2:]}\n{server.tail(150)}"
                chunks = [e for e in events[:-1]]
                assert not any("error" in e for e in chunks), [e for e in chunks if "error" in e]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert "".join(e["choices"][0]["text"] for e in chunks) == text
            assert statuses <= {(200, "ok"), (200, "degraded")}, statuses
            assert (200, "degraded") in statuses, statuses
            while http.get("/health").json()["status"] != "ok":   # back at its layout
                assert time.monotonic() - killed_at < 60, "/health not ok within 60 s of the kill"
                time.sleep(0.2)
            after = http.post("/v1/completions", json={**bodies[0], "stream": False}).json()
            assert after["choices"][0]["text"] == before[0]
            metrics = http.get("/metrics").text
        assert "moe_lost_ranks_total 1.0" in metrics and "moe_rank_reformations_total 1.0" in metrics, metrics[-2000:]
        now = rank_pids(server.process.pid)   # the three others kept their processes (and weights); rank 2 is new
        assert len(now) == 4 and set(workers) - set(now) == {workers[2]}, (workers, now)
        assert server.process.poll() is None, server.tail()
    finally:
        server.stop()
