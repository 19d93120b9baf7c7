"""The HTTP hardening over real sockets: one real `moe-serve --api-key` on a tiny checkpoint for the module.

While it starts, /health answers 503 {"status": "starting"} (it listens before the engine is built).
100 MB uploads, with and without the key, with a Content-Length or chunked, are refused early
(413 / 401) while /health keeps answering within a second and the front's memory stays flat.
HEAD /health has no body. With the key, the dashboard works in a real browser (the key as the
password of the browser's Basic-auth prompt).
"""
from __future__ import annotations

import base64
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest
from browser_gate import CHROMEDRIVER, CHROMIUM, require_browser
from server_harness import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)

KEY = "K-hardening"
BEARER = {"Authorization": f"Bearer {KEY}"}
UPLOAD_BYTES = 100 * 2**20
MAX_RSS_GROWTH_BYTES = 64 * 2**20
REFUSAL_BOUND_S = 3.0
# The stall the streams guard against, a front tokenizing one of these prompts whole on its loop, lasts 6-17 s; the
# uploads themselves (8 x 3.9 MB at once) beside the suite's other worker on 2 cores made gaps of 0.52-0.70 s in 2 of
# 5 full runs: a 0.5 s bound failed on that noise, while the stall it guards against stays far above 2 s
STREAM_GAP_BOUND_S = 2.0


@dataclass
class StartupProbe:
    """What /health and /v1/models answered from the moment the port was bound until /health said 200."""

    url: str
    health: list[tuple[int, dict | None]] = field(default_factory=list)
    models_while_starting: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self.stop.is_set():
                try:
                    response = client.get("/health")
                except httpx.TransportError:     # not listening yet
                    time.sleep(0.02)
                    continue
                body = response.json() if response.headers.get("content-type", "").startswith("application/json") \
                    else None
                self.health.append((response.status_code, body))
                if response.status_code == 200:
                    return
                if len(self.models_while_starting) < 3:
                    self.models_while_starting.append(client.get("/v1/models", headers=BEARER).status_code)
                time.sleep(0.02)


@pytest.fixture(scope="module")
def started(tiny_checkpoint_factory):
    """(the running server, what it answered while starting)."""
    checkpoint = tiny_checkpoint_factory("mixtral")
    port = free_port()
    probe = StartupProbe(f"http://127.0.0.1:{port}")
    prober = threading.Thread(target=probe.run, daemon=True)
    prober.start()
    server = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--port", str(port),
                            "--kv-cache-memory", "8M", "--api-key", KEY, "--log-level", "warning"])
    try:
        server.start()
        prober.join(10)
    finally:
        probe.stop.set()
    yield server, probe
    server.stop()


@pytest.fixture(scope="module")
def server(started):
    return started[0]


def test_health_answers_503_starting_until_the_engine_is_ready(started):
    server, probe = started
    statuses = [status for status, _ in probe.health]
    assert statuses and statuses[-1] == 200, probe.health
    assert statuses[0] == 503 and probe.health[0][1] == {"status": "starting"}, probe.health[:3]
    assert set(statuses[:-1]) == {503}
    # /v1/models is 503 while starting; the engine may become ready between a 503 /health and the models call
    # that follows it, so a last 200 may come (after every 503, never before one)
    models = probe.models_while_starting
    assert 503 in models and set(models) <= {503, 200} and models == sorted(models, key=lambda s: s == 200), models
    assert "moe-serve: listening on" in server.tail(200)


def test_head_health_is_200_without_a_body(server):
    response = httpx.head(server.base_url + "/health", timeout=5)
    assert response.status_code == 200 and response.content == b""


# ---- 100 MB uploads --------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class Watch:
    """Polls /health and the front's RSS from a thread while an upload runs."""

    url: str
    pid: int
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    peak_rss: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.is_set():
                self.peak_rss = max(self.peak_rss, rss_bytes(self.pid))
                start = time.perf_counter()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - start)
                if status != 200:
                    self.failures.append(f"/health {status}")
                time.sleep(0.05)


@dataclass
class UploadOutcome:
    status: int | None
    seconds: float
    bytes_sent: int


def upload(base_url: str, headers: dict[str, str], chunked: bool, timeout_s: float = 30.0) -> UploadOutcome:
    """POST a UPLOAD_BYTES JSON prompt from a sending thread; read the answer's status line as soon as it comes."""
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {UPLOAD_BYTES}"
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json", framing,
             *(f"{k}: {v}" for k, v in headers.items())]
    chunk = b"a" * 2**20
    sent = 0

    def send_all() -> None:
        nonlocal sent
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            pieces = [chunk] * (UPLOAD_BYTES // len(chunk))   # together one valid JSON object
            pieces[0] = b'{"prompt": "' + chunk[12:]
            pieces[-1] = chunk[2:] + b'"}'
            for piece in pieces:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass   # the server closed the connection: expected once it has answered

    start = time.perf_counter()
    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    received = b""
    try:
        while b"\r\n" not in received:
            data = sock.recv(4096)
            if not data:
                break
            received += data
    except OSError:
        pass
    seconds = time.perf_counter() - start
    sock.close()
    sender.join(10)
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else None
    return UploadOutcome(status, seconds, sent)


@pytest.mark.parametrize("with_key", [True, False], ids=["with-key", "without-key"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100mb_upload_is_refused_early_and_the_server_stays_responsive(server, with_key, chunked):
    rss_before = rss_bytes(server.process.pid)
    watch = Watch(server.base_url, server.process.pid)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    try:
        outcome = upload(server.base_url, BEARER if with_key else {}, chunked)
        time.sleep(0.3)     # a few more /health probes after the refusal
    finally:
        watch.stop.set()
        watcher.join(15)
    assert outcome.status == (413 if with_key else 401), outcome
    assert outcome.seconds < 5, outcome
    assert watch.latencies and not watch.failures, watch.failures
    assert max(watch.latencies) < 1.0, f"/health took {max(watch.latencies):.2f}s during the upload"
    growth = watch.peak_rss - rss_before
    assert growth < MAX_RSS_GROWTH_BYTES, f"the front grew by {growth / 2**20:.0f} MiB"
    assert httpx.get(server.base_url + "/v1/models", headers=BEARER, timeout=10).status_code == 200


# ---- the dashboard in a browser, with the key ---------------------------------------------------

def test_the_dashboard_works_in_a_browser_given_the_key(server, tmp_path):
    require_browser()   # fails without chromium/chromedriver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    assert httpx.get(server.base_url + "/dashboard", timeout=10).status_code == 401
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        parts = urlsplit(server.base_url)
        # the key as the password of the Basic-auth prompt (any user name), as a person would type it
        driver.get(f"http://user:{KEY}@{parts.netloc}/dashboard")
        WebDriverWait(driver, 30, poll_frequency=0.2).until(
            lambda d: d.execute_script("return document.getElementById('status').textContent").startswith("live"))
        trace_status = driver.execute_async_script(
            "const done = arguments[0];"
            "fetch(new URL('/dashboard/trace', location.origin)).then(r => done(r.status), e => done(String(e)));")
        assert trace_status == 200
    finally:
        driver.quit()
    expected = "Basic " + base64.b64encode(f"user:{KEY}".encode()).decode()
    assert httpx.get(server.base_url + "/dashboard/state", headers={"Authorization": expected},
                     timeout=10).status_code == 200


# ---- oversized prompts and stop strings (red team round 3) ---------------------------------------

@dataclass
class StreamGaps:
    """Streams completions one after another from a thread and records the longest wait between two chunks."""

    url: str
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    first_chunk: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"prompt": "the cat sat on the mat", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, headers=BEARER, timeout=30) as client:
            while not self.stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as response:
                    last = None
                    for line in response.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now
                        self.chunks += 1
                        self.first_chunk.set()


def test_oversized_prompts_are_refused_at_once_with_the_front_flat_and_streams_flowing(server):
    """8 concurrent 3.9 MB prompts ("a " * 1,950,000: 27-34 s of tokenizing each, +2.4 GB before) and a body
    with two 1 MB stop strings: each a 400 naming its field in under a second, the front's memory flat, and a
    stream running meanwhile never waits STREAM_GAP_BOUND_S for a chunk."""
    streams = StreamGaps(server.base_url)
    streamer = threading.Thread(target=streams.run, daemon=True)
    streamer.start()
    assert streams.first_chunk.wait(30)
    watch = Watch(server.base_url, server.process.pid)
    watcher = threading.Thread(target=watch.run, daemon=True)
    rss_before = rss_bytes(server.process.pid)
    watcher.start()
    answers: list[tuple[int, str | None, float]] = []

    def send(body: dict) -> None:
        started = time.perf_counter()
        response = httpx.post(server.base_url + "/v1/completions", json=body, headers=BEARER, timeout=60)
        answers.append((response.status_code, response.json()["error"].get("param"), time.perf_counter() - started))

    attackers = [threading.Thread(target=send, args=({"prompt": "a " * 1_950_000, "max_tokens": 4},))
                 for _ in range(8)]
    attackers.append(threading.Thread(target=send, args=({"prompt": "hi", "max_tokens": 4,
                                                         "stop": ["x" * 2**20, "y" * 2**20]},)))
    gaps_before = len(streams.gaps)
    for attacker in attackers:
        attacker.start()
    for attacker in attackers:
        attacker.join(60)
    time.sleep(0.5)
    watch.stop.set()
    streams.stop.set()
    watcher.join(15)
    streamer.join(60)
    assert sorted(param for _, param, _ in answers) == ["prompt"] * 8 + ["stop"], answers
    # alone on an idle machine each answer takes 0.3-0.9 s (3.9 MB uploads, 8 at once); the bound leaves room for
    # the suite's other worker: tokenizing these prompts whole took 6-17 s each
    assert all(status == 400 and seconds < REFUSAL_BOUND_S for status, _, seconds in answers), answers
    during = streams.gaps[gaps_before:]
    assert during and max(during) < STREAM_GAP_BOUND_S, f"a stream waited {max(during):.2f}s for a chunk"
    growth = watch.peak_rss - rss_before
    assert growth < 2 * MAX_RSS_GROWTH_BYTES, f"the front grew by {growth / 2**20:.0f} MiB"
