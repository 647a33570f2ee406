"""`slime dashboard RUN_DIR`: a running job's buffer attached live, a finished run's served from a
read-only copy (real redis-server; the slow test runs a real job and reads the page in Chromium)."""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from slime.buffer.redis_server import LocalRedisServer
from slime.buffer.store import TrajectoryStore
from slime.cli import main
from slime.dashboard.rundir import READ_ONLY_REASON, RunDirError, open_run_buffer
from slime.dashboard.server import DashboardServer
from slime.security import JobCredentials
from tests.helpers import TINY_JOB, needs, wait_for

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
JOB = "rundir-job"


def _hashes(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _fake_run(run_dir: Path, buffer_url: str | None = None) -> JobCredentials:
    """The files a job writes at start: config.yaml and job.secret (JobCredentials.create)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"job_name": JOB, "buffer": {"url": buffer_url}}))
    return JobCredentials.create(run_dir, own_redis=buffer_url is None)


@pytest.fixture
def job_server(tmp_path: Path) -> Iterator[tuple[Path, LocalRedisServer, JobCredentials]]:
    """A run dir whose buffer is a redis-server started as the job starts it, holding one group."""
    run_dir = tmp_path / "run"
    credentials = _fake_run(run_dir)
    server = LocalRedisServer(run_dir / "redis", aof=True, password=credentials.redis_password)
    store = TrajectoryStore.open(server.url, JOB, password=credentials.redis_password)
    store.add_group([10, 11, 12], 2, 16, {"prompt_text": "rundir probe"})
    store.close()
    yield run_dir, server, credentials
    server.stop()


def test_a_running_jobs_dashboard_attaches_live(job_server):
    """Through the command: it finds the job's server from the run dir and takes control routes."""
    run_dir, server, credentials = job_server
    proc, first = _start_dashboard(run_dir)
    try:
        match = re.search(r": (http://\S+) \(running job: attached live to (\S+);", first)
        assert match and match.group(2) == server.url, first
        url = match.group(1)
        summary = httpx.get(url + "api/summary", timeout=10).json()
        assert summary["read_only"] is False and summary["groups"]["total"] == 1
        assert summary["samples_by_status"]["pending"] == 2
        auth = {"X-Slime-Token": credentials.token("dashboard")}
        reply = httpx.post(url + "api/control/pause", headers=auth, json={}, timeout=10)
        assert reply.status_code == 200 and reply.json()["paused"] is True  # a live job takes control
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert server.running  # the command leaves the job's server alone


def test_a_job_with_a_literal_dashboard_token_is_controlled_with_that_token(job_server):
    """dashboard.token set in the config: the job writes it to run_dir/dashboard.token (config.yaml
    keeps it redacted), and the command serves that token, not the one derived from the secret."""
    run_dir, _, credentials = job_server
    literal = "a-literal-dashboard-token"
    (run_dir / "dashboard.token").write_text(literal + "\n")
    proc, first = _start_dashboard(run_dir)
    try:
        url = re.search(r": (http://\S+) \(running job", first).group(1)
        for token, status in ((credentials.token("dashboard"), 401), (literal, 200)):
            reply = httpx.post(url + "api/control/pause", headers={"X-Slime-Token": token}, json={}, timeout=10)
            assert reply.status_code == status
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_finished_run_is_served_from_a_copy_that_is_deleted(job_server):
    run_dir, server, credentials = job_server
    server.stop()
    before = _hashes(run_dir)
    run = open_run_buffer(run_dir)
    try:
        assert run.read_only and run.copy_dir.is_dir() and not run.copy_dir.is_relative_to(run_dir)
        token = credentials.token("dashboard")
        dash = DashboardServer(
            run.url, run.job, token=token, redis_password=run.redis_password, read_only=READ_ONLY_REASON
        ).start()
        wait_for(lambda: dash.server.started, 10, "the dashboard to listen")
        try:
            summary = httpx.get(dash.url + "api/summary", timeout=10).json()
            assert summary["read_only"] is True and summary["samples_by_status"]["pending"] == 2
            reply = httpx.post(dash.url + "api/control/pause", headers={"X-Slime-Token": token}, json={}, timeout=10)
            assert reply.status_code == 409 and reply.json()["detail"] == READ_ONLY_REASON
        finally:
            dash.stop()
    finally:
        run.close()
    assert not run.copy_dir.exists()
    assert _hashes(run_dir) == before


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["dashboard", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("slime: ") and lines[1].startswith("  hint: "), err
    return err


def test_errors_are_one_line_and_a_hint(tmp_path, capsys):
    assert "is not a directory" in _cli_error([str(tmp_path / "nowhere")], capsys)
    assert "has no config.yaml" in _cli_error([str(tmp_path)], capsys)

    run_dir = tmp_path / "run"
    _fake_run(run_dir)
    assert "holds no stored buffer" in _cli_error([str(run_dir)], capsys)
    (run_dir / "job.secret").unlink()
    assert "has no job.secret" in _cli_error([str(run_dir)], capsys)

    assert "from the run directory" in _cli_error([str(run_dir), "--job", JOB], capsys)
    assert "needs a run directory" in _cli_error([], capsys)

    remote = tmp_path / "remote"
    _fake_run(remote, buffer_url="redis://:***@127.0.0.1:1/0")  # config.yaml keeps no password
    os.environ.pop("SLIME_REDIS_PASSWORD", None)
    assert "SLIME_REDIS_PASSWORD" in _cli_error([str(remote)], capsys)
    _fake_run(tmp_path / "gone", buffer_url="redis://127.0.0.1:1/0")
    with pytest.raises(RunDirError, match="does not answer"):
        open_run_buffer(tmp_path / "gone")


def test_a_run_on_an_external_redis_is_attached_there(redis_url, tmp_path):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, buffer_url=redis_url)
    store = TrajectoryStore.open(redis_url, JOB)
    try:
        store.add_group([1, 2], 1, 8, {})
        run = open_run_buffer(run_dir)
        assert not run.read_only and run.url == redis_url and run.redis_password is None
    finally:
        store.delete_job()
        store.close()


# ---- a whole run, finished, through the real command -----------------------------------------------
@pytest.fixture(scope="module")
def finished_run(ray_session, tiny_model_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A short job on its own redis-server (no buffer.url), run to completion."""
    from slime.config import load_config
    from slime.train import train

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    history = train(
        load_config(
            None,
            [
                f"job_name={JOB}",
                f"output_dir={run_dir}",
                f"model.path={tiny_model_dir}",
                *TINY_JOB,
                "steps=2",
            ],
        )
    )
    assert len(history) == 2
    return run_dir, history


def _start_dashboard(run_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """`slime dashboard RUN_DIR --port 0` and the line it prints once it listens."""
    cmd = [sys.executable, "-m", "slime.cli", "dashboard", str(run_dir), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        return proc, lines.get(timeout=60)
    except queue.Empty:
        proc.kill()
        raise AssertionError("slime dashboard printed no URL") from None


@pytest.mark.slow
@needs(bool(CHROMIUM and CHROMEDRIVER), "needs apt packages chromium and chromium-driver")
def test_a_finished_runs_dashboard_is_read_only_and_leaves_the_run_untouched(finished_run):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    run_dir, history = finished_run
    before = _hashes(run_dir)
    assert "redis/appendonlydir" in {str(Path(k).parent) for k in before}
    token = JobCredentials.read(run_dir).token("dashboard")
    auth = {"X-Slime-Token": token}
    started = time.monotonic()
    proc, first = _start_dashboard(run_dir)
    try:
        print(f"dashboard up in {time.monotonic() - started:.1f}s")
        match = re.search(r": (http://\S+) \(finished run: serving a read-only copy of its buffer from (\S+),", first)
        assert match, first
        url, copy_dir = match.group(1), Path(match.group(2))
        assert copy_dir.is_dir()
        summary = httpx.get(url + "api/summary", timeout=10).json()
        assert summary["read_only"] is True and summary["job"] == JOB
        assert summary["step"] == 1 and summary["policy_version"] == history[-1]["policy_version"]
        assert summary["groups"]["trained"] == sum(h["groups"] for h in history) == 4
        assert summary["generated_tokens"] == sum(h["generated_tokens"] for h in history) > 0
        rows = httpx.get(url + "api/trajectories", params={"limit": 200}, timeout=10).json()["items"]
        assert len(rows) == sum(summary["samples_by_status"].values()) == sum(h["samples"] for h in history) == 8
        assert sum(r["response_length"] for r in rows) == sum(h["trained_tokens"] for h in history)

        probe = max(rows, key=lambda r: r["response_length"])
        detail = httpx.get(url + f"api/trajectories/{probe['id']}", timeout=10).json()
        assert len(detail["tokens"]) == probe["response_length"] > 0

        for path, body in (("api/control/pause", {}), (f"api/trajectories/{probe['id']}/drop", {"reason": "x"})):
            reply = httpx.post(url + path, headers=auth, json=body, timeout=10)
            assert reply.status_code == 409 and reply.json()["detail"] == READ_ONLY_REASON

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(arg)
        browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            browser.get(f"{url}#token={token}")
            badge = browser.find_element(By.ID, "read-only")
            wait_for(lambda: badge.is_displayed(), 30, "the read-only badge")
            assert not browser.find_element(By.ID, "controls").is_displayed()
            wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-id="{probe["id"]}"]'), 30, "the row")
            browser.find_element(By.CSS_SELECTOR, f'tr[data-id="{probe["id"]}"]').click()
            tokens = lambda: browser.find_elements(By.CSS_SELECTOR, "#inspector-tokens .tok")  # noqa: E731
            wait_for(lambda: len(tokens()) == len(detail["tokens"]), 20, "the trajectory's tokens in the page")
            assert [t.get_attribute("textContent") for t in tokens()] == [k["text"] for k in detail["tokens"]]
            assert not browser.find_element(By.ID, "inspector-actions").is_displayed()
        finally:
            browser.quit()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not copy_dir.exists()
    assert _hashes(run_dir) == before


def test_the_copy_a_killed_dashboard_left_is_removed_by_the_next_one(job_server):
    """SIGKILL skips every cleanup: the copy of the buffer stayed in /tmp. Each copy names its
    dashboard's pid; the next dashboard removes the copies whose dashboard is gone, and only those."""
    import tempfile

    run_dir, server, _ = job_server
    server.stop()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = Path(tempfile.mkdtemp(prefix="slime-dashboard-copy-"))
    (orphan / "dashboard.pid").write_text(str(dead.pid))
    (orphan / "appendonlydir").mkdir()
    alive = Path(tempfile.mkdtemp(prefix="slime-dashboard-copy-"))
    (alive / "dashboard.pid").write_text(str(os.getppid()))
    run = open_run_buffer(run_dir)
    try:
        assert not orphan.exists() and alive.is_dir()
        assert (run.copy_dir / "dashboard.pid").read_text() == str(os.getpid())
    finally:
        run.close()
        shutil.rmtree(alive)
    assert not run.copy_dir.exists()
