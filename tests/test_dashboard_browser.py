"""The dashboard in a real headless Chromium against a real `moe-serve --ep 2 --dp-attn 2` under load.

Checks what a person would look at: the page loads without console errors, the heatmap has the
model's layers x experts and shows the numbers /v1/expert_load reports, values move while requests
flow, a rebalance triggered from the button lands on the time axis, a dead rank turns the status
red, and the page reconnects by itself to a restarted server. Set MOE_DASHBOARD_SCREENSHOT=1 to
also write the README's screenshot (skewed workload, after a rebalance) to bench/results/dashboard.png.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from browser_gate import CHROMEDRIVER, CHROMIUM, require_browser
from process_tree import descendants, rank_pids
from server_harness import REPO_ROOT, ServerProcess

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--window-size=1400,1900"]
NUM_EXPERTS, NUM_REDUNDANT = 8, 2            # the tiny mixtral: 8 experts; 2 extra slots for replicas
SKEWED_PROMPT = "the the the the the the the the"   # one token over and over: routing piles onto few experts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def browser_installed():
    """Fails the module without chromium or chromedriver (browser_gate)."""
    require_browser()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def moe_server(checkpoint, tmp_path_factory):
    # An empty HOME: this machine has no CPU calibration for the plan view, as on a fresh server.
    server = ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--ep", "2", "--dp-attn", "2",
                            "--num-redundant-experts", str(NUM_REDUNDANT), "--kv-cache-memory", "8M",
                            "--max-rank-restarts", "0"],   # the last test's dead rank ends the server
                           env={"HOME": str(tmp_path_factory.mktemp("home"))})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_script_timeout(20)
    yield driver
    driver.quit()


class Traffic:
    """Background threads sending completions until stopped (a context manager)."""

    def __init__(self, base_url: str, prompt: str, threads: int = 3, max_tokens: int = 16):
        self.base_url, self.prompt, self.max_tokens = base_url, prompt, max_tokens
        self.stop_event = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(threads)]

    def _send(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not self.stop_event.is_set():
                response = client.post("/v1/completions", json={"prompt": self.prompt, "max_tokens": self.max_tokens})
                if response.status_code == 200:
                    self.completed += 1
                else:
                    self.errors.append(response.text)

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(60)


def wait_for(driver, condition, timeout_s: float = 20.0, what: str = "the dashboard"):
    """WebDriverWait on `condition(driver)`; the failure says what was awaited and shows the page status."""
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(condition)
    except Exception as exc:
        status = driver.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {what} (status: {status!r})") from exc


def page_state(driver) -> dict | None:
    return driver.execute_script("return window.moeDashboard && window.moeDashboard.state")


def renders(driver) -> int:
    return driver.execute_script("return window.moeDashboard ? window.moeDashboard.renders : 0")


def chart(driver, element_id: str) -> dict:
    """What plotly draws in one chart: its traces and layout, as the page handed them to Plotly.react."""
    return driver.execute_script(
        "const gd = document.getElementById(arguments[0]);"
        "return {data: gd.data, layout: {shapes: gd.layout.shapes || [], annotations: gd.layout.annotations || []}};",
        element_id)


def text_of(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def number(text: str) -> float:
    """A figure shown on the page ('–' while there is none yet)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot_stddev(driver, png: bytes) -> float:
    """Standard deviation of the screenshot's gray levels (0 for a blank page), decoded by the browser."""
    return driver.execute_async_script("""
        const [data, done] = arguments;
        const img = new Image();
        img.onload = () => {
          const canvas = document.createElement("canvas");
          canvas.width = img.width; canvas.height = img.height;
          const ctx = canvas.getContext("2d");
          ctx.drawImage(img, 0, 0);
          const px = ctx.getImageData(0, 0, img.width, img.height).data;
          let sum = 0, sq = 0;
          for (let i = 0; i < px.length; i += 4) { const v = (px[i] + px[i + 1] + px[i + 2]) / 3; sum += v; sq += v * v; }
          const n = px.length / 4, mean = sum / n;
          done(Math.sqrt(sq / n - mean * mean));
        };
        img.onerror = () => done(-1);
        img.src = "data:image/png;base64," + data;
    """, base64.b64encode(png).decode())


def save_screenshot(driver, path: Path) -> None:
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot_stddev(driver, png) > 20, f"{path} looks blank"


def num_moe_layers(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]  # every mixtral layer is MoE


def test_heatmap_shows_the_models_experts_and_the_numbers_of_v1_expert_load(moe_server, browser, checkpoint,
                                                                            tmp_path):
    browser.get(moe_server.base_url + "/dashboard")
    wait_for(browser, lambda d: renders(d) >= 1 and text_of(d, "status").startswith("live"), what="a first render")
    layers = num_moe_layers(checkpoint)
    z = chart(browser, "heatmap")["data"][0]["z"]
    assert len(z) == layers and all(len(row) == NUM_EXPERTS for row in z)

    with Traffic(moe_server.base_url, SKEWED_PROMPT) as traffic:
        first = page_state(browser)["expert_load"]
        wait_for(browser, lambda d: page_state(d)["expert_load"]["steps"] > first["steps"] + 5, what="steps to grow")
        moved = page_state(browser)["expert_load"]
        wait_for(browser, lambda d: page_state(d)["expert_load"]["steps"] > moved["steps"], what="more steps")
        later = chart(browser, "heatmap")["data"][0]["z"]
        assert later != first["counts"], "the heatmap did not change while requests flowed"
        wait_for(browser, lambda d: number(text_of(d, "summary-tokens")) > 0, what="a token rate above 0")
    assert traffic.completed > 0 and not traffic.errors

    # the engine is idle now: the page settles on exactly what /v1/expert_load reports
    deadline = time.monotonic() + 20
    while True:
        fresh = httpx.get(moe_server.base_url + "/v1/expert_load", timeout=10).json()
        shown = page_state(browser)["expert_load"]
        if shown["steps"] == fresh["steps"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert shown["steps"] == fresh["steps"], "the page never showed the latest snapshot"
    wait_for(browser, lambda d: text_of(d, "summary-steps") == str(fresh["steps"]), what="the step count")
    assert chart(browser, "heatmap")["data"][0]["z"] == fresh["counts"]
    assert text_of(browser, "summary-window") == str(fresh["window"])
    bars = chart(browser, "rank-load")["data"]
    assert [trace["y"] for trace in bars[:2]] == [[row[r] for row in fresh["rank_load"]] for r in range(2)]
    assert bars[2]["y"] == fresh["balancedness"]
    assert any(sum(row) > 0 for row in fresh["counts"])

    browser.find_element(By.ID, "view-physical").click()
    wait_for(browser, lambda d: len(chart(d, "heatmap")["data"][0]["x"]) == NUM_EXPERTS + NUM_REDUNDANT,
             what="the physical-slot view")
    physical = chart(browser, "heatmap")["data"][0]
    replicated = {e for row in fresh["placement"] for e in row if row.count(e) > 1}
    labels = {label for row in physical["text"] for label in row}
    assert replicated and {f"e{e}*" for e in replicated} <= labels
    placement = chart(browser, "placement")["data"][0]
    assert [[int(t[1:]) for t in row] for row in placement["text"]] == [fresh["placement"][0][:5], fresh["placement"][0][5:]]
    browser.find_element(By.ID, "view-logical").click()

    save_screenshot(browser, tmp_path / "dashboard.png")
    assert console_errors(browser) == []


def test_opening_the_dashboard_measures_nothing_and_says_how_to_calibrate(moe_server, browser):
    """No CPU calibration on the server: under load the page renders its charts within 10 s, its plan section
    plans for a GPU table and names the calibrate command, and no process was started for it."""
    before = descendants(moe_server.process.pid)
    with Traffic(moe_server.base_url, "hello there") as traffic:
        opened = time.monotonic()
        browser.get(moe_server.base_url + "/dashboard")
        wait_for(browser, lambda d: renders(d) >= 1 and len(chart(d, "heatmap")["data"]) > 0, timeout_s=10,
                 what="the charts under load")
        charts_s = time.monotonic() - opened
        wait_for(browser, lambda d: "moe-serve plan --gpu cpu --calibrate" in text_of(d, "plan-calibration"),
                 timeout_s=10, what="the plan section's calibration line")
        answer = browser.execute_script("return window.moePlan.answer")
        spawned = descendants(moe_server.process.pid) - before
    assert charts_s < 10
    assert answer["gpu"] == "h100" and answer["rows"], answer.get("calibration")
    assert not spawned, f"opening the dashboard started processes: {spawned}"
    assert traffic.completed > 0 and not traffic.errors


def test_a_rebalance_from_the_button_is_marked_on_the_time_axis(moe_server, browser):
    browser.get(moe_server.base_url + "/dashboard")
    wait_for(browser, lambda d: renders(d) >= 1, what="a first render")
    assert page_state(browser)["rebalance"]["available"], page_state(browser)["rebalance"]["reason"]
    for_readme = bool(os.environ.get("MOE_DASHBOARD_SCREENSHOT"))   # a longer history makes a better picture
    with Traffic(moe_server.base_url, SKEWED_PROMPT):
        start = page_state(browser)["expert_load"]["steps"]
        wait_for(browser, lambda d: page_state(d)["expert_load"]["steps"] > start + 20, what="a skewed window")
        time.sleep(8 if for_readme else 0)
        browser.find_element(By.ID, "rebalance-button").click()
        wait_for(browser, lambda d: text_of(d, "rebalance-note").startswith("rebalance #"), timeout_s=60,
                 what="the rebalance to finish")
        wait_for(browser, lambda d: len(chart(d, "timeline")["layout"]["shapes"]) >= 1, what="the rebalance marker")
        if for_readme:
            time.sleep(8)
            save_screenshot(browser, REPO_ROOT / "bench" / "results" / "dashboard.png")
    events = page_state(browser)["rebalance"]["events"]
    assert events and events[-1]["trigger"] == "manual" and events[-1]["ok"], events
    event = events[-1]
    timeline = chart(browser, "timeline")
    marker = timeline["layout"]["annotations"][-1]["text"]
    assert marker == f"{event['experts_moved']} moved · {event['duration_s']:.2f} s"
    assert any(trace["name"] == "rebalance" for trace in timeline["data"])
    assert f"{event['experts_moved']} experts moved" in text_of(browser, "rebalance-note")
    assert text_of(browser, "summary-rebalances") == str(len(events))
    assert console_errors(browser) == []


def test_a_dead_rank_turns_the_status_red_and_the_page_reconnects_to_a_restarted_server(moe_server, browser,
                                                                                          checkpoint):
    browser.get(moe_server.base_url + "/dashboard")
    wait_for(browser, lambda d: text_of(d, "status").startswith("live"), what="a live status")
    workers = rank_pids(moe_server.process.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    wait_for(browser, lambda d: text_of(d, "status").startswith("engine unhealthy"), what="the dead rank")
    assert "rank" in text_of(browser, "status") and "error" in browser.find_element(By.ID, "status").get_attribute("class")

    port = int(moe_server.base_url.rsplit(":", 1)[1])
    moe_server.stop()
    wait_for(browser, lambda d: text_of(d, "status").startswith("disconnected"), what="the lost server")
    # the same port, now a one-rank server: the page picks it up without a reload (and has no expert load to show)
    with ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--port", str(port),
                        "--kv-cache-memory", "8M"]):
        wait_for(browser, lambda d: "reconnected after a server restart" in text_of(d, "status"), timeout_s=30,
                 what="the reconnect")
        assert browser.find_element(By.ID, "no-expert-load").is_displayed()
        assert not browser.find_element(By.ID, "rebalance-button").is_enabled()
        assert text_of(browser, "rebalance-note").startswith("not available")
