"""The dashboard page in headless Chromium (Debian's chromium + chromedriver, driven by Selenium)
during a real run started with `slime train ... dashboard.enabled=true`."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slime.buffer import BufferQueries, JobTelemetry, TrajectoryStore
from tests.helpers import needs, wait_for

pytestmark = pytest.mark.slow

TOKEN = "browser-token-42"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def running_job(tiny_model_dir, redis_url, tmp_path):
    """`slime train` in a subprocess with the dashboard on; yields (url, buffer); SIGTERM at the end."""
    job = f"dash-browser-{os.getpid()}"
    cmd = [
        sys.executable,
        "-m",
        "slime.cli",
        "train",
        f"job_name={job}",
        f"output_dir={tmp_path / 'run'}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        "steps=500",
        "april.enabled=true",
        "rollout.batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=32",
        "data.num_generated=64",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "dashboard.enabled=true",
        f"dashboard.port={_free_port()}",
        f"dashboard.token={TOKEN}",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.time() + 240
        url = None
        while url is None:
            assert proc.poll() is None, "the job exited early:\n" + "".join(log[-40:])
            assert time.time() < deadline, "the job printed no dashboard URL:\n" + "".join(log[-40:])
            try:
                match = re.search(r"dashboard: (http://\S+)", lines.get(timeout=1))
                url = match.group(1) if match else None
            except queue.Empty:
                pass
        yield url, TrajectoryStore.open(redis_url, job)
    finally:
        proc.send_signal(signal.SIGTERM)  # the job stores its partials and stops
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        TrajectoryStore.open(redis_url, job).delete_job()


def _rows(buffer: TrajectoryStore) -> list[dict]:
    q = BufferQueries(buffer.connection)
    return q.sample_rows([sid for _, sids in q.group_rows(q.group_ids_by_rank(0, 10**6)) for sid in sids])


@needs(bool(CHROMIUM and CHROMEDRIVER), "needs apt packages chromium and chromium-driver")
def test_page_shows_the_live_job_and_colours_tokens(running_job, tmp_path):
    from selenium import webdriver
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    url, buffer = running_job
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2200",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        browser.get(f"{url}#token={TOKEN}")  # a fragment: the token never goes to the server in a URL
        text = lambda id_: browser.find_element(By.ID, id_).text  # noqa: E731

        def click(selector: str) -> bool:
            try:  # the table is redrawn every few seconds: an element may go stale under us
                browser.find_element(By.CSS_SELECTOR, selector).click()
                return True
            except (NoSuchElementException, StaleElementReferenceException):
                return False

        wait_for(lambda: text("live") == "live", 30, "the live stream to connect")
        wait_for(lambda: text("generated-tokens") not in ("", "0"), 120, "generated tokens on the page")
        first = int(text("generated-tokens"))
        wait_for(lambda: int(text("generated-tokens")) > first, 60, "the token counter to change")
        assert text("job") == buffer.job

        # Pause from the page: the driver pauses the workers and no token is generated meanwhile.
        browser.find_element(By.ID, "btn-pause").click()
        wait_for(
            lambda: any(e["kind"] == "rollout_paused" for e in JobTelemetry(buffer.connection).events(20)),
            30,
            "the driver to pause",
        )
        time.sleep(0.5)  # a decode step in progress when the pause arrived may still land
        frozen = buffer.stats()["generated_tokens"]
        time.sleep(1.5)
        assert buffer.stats()["generated_tokens"] == frozen
        wait_for(lambda: not browser.find_element(By.ID, "paused").get_attribute("hidden"), 10, "the paused badge")

        # While paused: a trajectory with env tokens (loss mask 0) and two policy versions.
        gid = buffer.add_group([10, 11, 12], 1, 16, {"prompt_text": "inspector probe"})
        leased = buffer.lease("w-browser", 1000)  # the queue's other samples go back at once, as partials
        for s in leased:
            if s.group_id != gid:
                buffer.release(s.id, "w-browser")
        [probe] = [s for s in leased if s.group_id == gid]
        buffer.append_chunk(probe.id, "w-browser", [20, 21, 22], [-0.1, -0.2, -0.3], 0)
        buffer.append_chunk(probe.id, "w-browser", [23, 24], [0.0, 0.0], 0, loss_mask=0)  # tool output
        buffer.append_chunk(probe.id, "w-browser", [25, 26, 27], [-0.4, -0.5, -0.6], 1)

        browser.find_element(By.ID, "btn-refresh").click()
        wait_for(lambda: click(f'tr[data-id="{probe.id}"]'), 20, "the probe's row to click")
        wait_for(
            lambda: len(browser.find_elements(By.CSS_SELECTOR, "#inspector-tokens .tok")) == 8,
            20,
            "the probe's tokens in the inspector",
        )
        spans = browser.find_elements(By.CSS_SELECTOR, "#inspector-tokens .tok")
        colour = [s.value_of_css_property("background-color") for s in spans]
        assert colour[0] == colour[1] == colour[2] != colour[5] == colour[6] == colour[7]  # v0 vs v1
        assert [s.get_attribute("data-version") for s in spans] == ["0"] * 5 + ["1"] * 3
        masked = [s for s in spans if "masked" in s.get_attribute("class")]
        assert len(masked) == 2 and {s.value_of_css_property("background-color") for s in masked} == {
            "rgba(213, 216, 220, 1)"
        }  # grey, whatever their version
        JobTelemetry(buffer.connection).drop_sample(probe.id, "browser test probe")

        # Open a trajectory the job generated, resume, and watch the counters move again.
        generated = [r["id"] for r in _rows(buffer) if r["response_length"] > 0 and r["id"] != probe.id]
        assert generated, "no generated trajectory in the buffer"
        browser.find_element(By.ID, "btn-refresh").click()
        # The page lists the newest 50 trajectories; _rows is oldest first.
        wait_for(lambda: any(click(f'tr[data-id="{sid}"]') for sid in generated[-10:]), 20, "a generated row to click")
        wait_for(
            lambda: (
                browser.find_elements(By.CSS_SELECTOR, "#inspector-tokens .tok") and text("inspector-id") in generated
            ),
            20,
            "a generated trajectory in the inspector",
        )
        browser.find_element(By.ID, "btn-resume").click()
        paused_at = int(text("generated-tokens"))
        wait_for(lambda: int(text("generated-tokens")) > paused_at, 60, "generation to resume")
        # Per-expert load arrives from the workers' router counts within a few seconds of decoding.
        wait_for(lambda: text("experts-note") == "", 30, "the expert-load chart to have data")
        # The train-inference mismatch chart draws each trained step's per-kind figures.
        # (textContent: the legend may lie outside the window, where Selenium's .text reads "")
        legend = "return [...document.getElementById('legend-mismatch').children].map(c => c.textContent)"
        wait_for(lambda: browser.execute_script(legend) == ["fresh", "resumed", "stale"], 30, "the mismatch legend")
        wait_for(
            lambda: browser.execute_script(
                "return steps.some(s => typeof s.mismatch_fresh_logp_abs_diff === 'number')"
            ),
            90,
            "a trained step's mismatch figures on the page",
        )
        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        browser.quit()
