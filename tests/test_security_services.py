"""Issue 22, the dashboard, the reward server and the OpenAI-compatible server: each finding replayed
as an attack against the real server on loopback (uvicorn on a thread, or the real CLI in a
subprocess), refused, and then the next honest request served."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
import redis
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from rewards.mix import RewardSpecError, describe_spec, load_reward_spec
from rewards.runner import RewardRunner
from rewards.server import ServerThread, make_app
from rewards.service import make_reward_service
from slime.buffer import JobTelemetry, TrajectoryStore
from slime.buffer.redis_server import LocalRedisServer
from slime.config import RewardConfig, load_config
from slime.dashboard import reader as dashboard_reader
from slime.dashboard.app import MAX_STREAMS, MAX_STREAMS_PER_CLIENT, create_app
from slime.dashboard.server import DashboardProcess, DashboardServer
from slime.security import API_TOKEN_ENV
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
TOKEN = "security-test-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SECRET_KEY = "sk-live-DO-NOT-SHOW-4242"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != API_TOKEN_ENV}
    return {**env, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled", **extra}


def _fill(buffer: TrajectoryStore, groups: int = 6) -> None:
    """A few groups with tokens and rewards, so the distributions have something to count."""
    for g in range(groups):
        buffer.add_group([1, 2, 3], 2, 16, {"prompt_text": f"p{g}"})
        for sample in buffer.lease("w-sec", 10):
            buffer.append_chunk(sample.id, "w-sec", list(range(g + 1)), [-0.5] * (g + 1), g % 3)


# ================================================================================ dashboard


@pytest.fixture
def dashboard(buffer: TrajectoryStore) -> Iterator[DashboardServer]:
    """`DashboardServer` on loopback with a token, over a job with a few trajectories."""
    _fill(buffer)
    server = DashboardServer(buffer.url, buffer.job, port=0, token=TOKEN).start()
    wait_for(lambda: _ok(server.url + "api/summary"), 20, "the dashboard to serve")
    yield server
    server.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_dashboard_takes_query_token_only_on_the_stream(buffer):
    """Off loopback every route needs the token; `?token=` (which lands in logs and history) opens
    only the live stream, which a browser's EventSource cannot give a header."""
    _fill(buffer, 2)
    app = create_app(buffer.url, buffer.job, TOKEN, bind_host="0.0.0.0")  # policy of a non-loopback bind
    with ServerThread(app) as server:
        base = server.url
        assert httpx.get(f"{base}/api/summary", params={"token": TOKEN}).status_code == 401
        assert httpx.get(f"{base}/metrics", params={"token": TOKEN}).status_code == 401
        assert httpx.get(f"{base}/api/summary").status_code == 401
        assert httpx.get(f"{base}/api/summary", headers={"X-Slime-Token": "wrong-token-0000"}).status_code == 401
        # The honest ways still work: a header on any route, `?token=` on the stream.
        assert httpx.get(f"{base}/api/summary", headers=BEARER).json()["job"] == buffer.job
        assert httpx.get(f"{base}/api/summary", headers={"X-Slime-Token": TOKEN}).status_code == 200
        with httpx.stream("GET", f"{base}/api/stream", params={"token": TOKEN, "interval": 0.2}, timeout=10) as r:
            assert r.status_code == 200
            data = next(line for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(data[5:])["job"] == buffer.job
        # The page and its assets hold no data: open, so the page can ask for the token.
        assert httpx.get(f"{base}/").status_code == 200
        assert httpx.get(f"{base}/static/app.js").status_code == 200


def test_dashboard_control_needs_the_header_even_on_loopback(dashboard, buffer):
    url = dashboard.url
    assert httpx.get(url + "api/summary").status_code == 200  # reads are open on loopback
    assert httpx.post(url + "api/control/pause", json={}).status_code == 401
    assert httpx.post(url + "api/control/pause", params={"token": TOKEN}, json={}).status_code == 401
    assert JobTelemetry(buffer.connection).get_control().get("paused") != "1"
    r = httpx.post(url + "api/control/pause", headers=BEARER, json={})
    assert r.status_code == 200 and r.json()["paused"] is True


def test_dashboard_refuses_cross_site_posts_and_foreign_hosts(dashboard, buffer):
    url = dashboard.url
    # A page elsewhere can post text/plain without a CORS preflight: refused before anything runs,
    # with or without the token.
    for headers in ({}, BEARER):
        r = httpx.post(url + "api/control/pause", content=b"{}", headers={"Content-Type": "text/plain", **headers})
        assert r.status_code == 415
    assert JobTelemetry(buffer.connection).get_control().get("paused") != "1"
    # DNS rebinding: a name that resolves to 127.0.0.1 carries its own Host header.
    port = dashboard.port
    for host in (f"evil.example:{port}", "attacker.test", f"127.0.0.1.evil.example:{port}"):
        assert httpx.get(url + "api/summary", headers={"Host": host}).status_code == 421
    assert httpx.get(url + "api/summary", headers={"Host": f"localhost:{port}"}).status_code == 200
    r = httpx.post(url + "api/control/pause", headers=BEARER, json={})
    assert r.status_code == 200 and JobTelemetry(buffer.connection).get_control()["paused"] == "1"


def _open_stream(
    stack: contextlib.ExitStack,
    client: httpx.Client,
    url: str,
    headers: dict[str, str] | None = None,
    token_in_query: str | None = None,
) -> int:
    params = {"interval": 10, **({"token": token_in_query} if token_in_query else {})}
    response = stack.enter_context(client.stream("GET", url + "api/stream", params=params, headers=headers, timeout=10))
    return response.status_code


def _client_from(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10)


def test_dashboard_limits_live_streams_per_client_and_in_total(dashboard):
    url = dashboard.url
    with contextlib.ExitStack() as stack:
        greedy = stack.enter_context(_client_from("127.0.0.1"))
        assert [_open_stream(stack, greedy, url) for _ in range(MAX_STREAMS_PER_CLIENT)] == [
            200
        ] * MAX_STREAMS_PER_CLIENT
        with contextlib.ExitStack() as extra:
            assert _open_stream(extra, greedy, url) == 429  # its share is used up ...
        other = stack.enter_context(_client_from("127.0.0.2"))
        assert _open_stream(stack, other, url) == 200  # ... while another client still gets one
        # Fill the rest of the total from more addresses: then everyone gets 503.
        clients, held = {"127.0.0.2": other}, {"127.0.0.1": MAX_STREAMS_PER_CLIENT, "127.0.0.2": 1}
        for address in (f"127.0.0.{i}" for i in range(2, 40)):
            client = clients.get(address) or stack.enter_context(_client_from(address))
            while held.get(address, 0) < MAX_STREAMS_PER_CLIENT and sum(held.values()) < MAX_STREAMS:
                assert _open_stream(stack, client, url) == 200
                held[address] = held.get(address, 0) + 1
        assert sum(held.values()) == MAX_STREAMS
        with contextlib.ExitStack() as extra:
            late = extra.enter_context(_client_from("127.0.0.99"))
            assert _open_stream(extra, late, url) == 503

    # Every stream closed: their slots come back.
    def stream_again() -> bool:
        with contextlib.ExitStack() as again:
            return _open_stream(again, again.enter_context(_client_from("127.0.0.1")), url) == 200

    wait_for(stream_again, 20, "the closed streams' slots to come back")


def test_streams_without_the_token_cannot_lock_the_token_holder_out(dashboard):
    """On loopback every local user is 127.0.0.1 and may read without the token: their streams, from
    however many addresses, use up only their own share. The token holder's (in a header or in
    `?token=`) are counted apart; a wrong token counts as none."""
    url = dashboard.url
    wrong = {"X-Slime-Token": "wrong-token-0000"}
    whole_share = [200] * MAX_STREAMS_PER_CLIENT
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(_client_from("127.0.0.1"))
        opened = [_open_stream(stack, local, url) for _ in range(MAX_STREAMS_PER_CLIENT)]
        with contextlib.ExitStack() as extra:
            refused = [_open_stream(extra, local, url), _open_stream(extra, local, url, wrong, "wrong-token-0000")]
        assert opened == whole_share and refused == [429, 429]
        for i in range(2, 1 + MAX_STREAMS // MAX_STREAMS_PER_CLIENT):  # the rest of the total, from more addresses
            other = stack.enter_context(_client_from(f"127.0.0.{i}"))
            assert [_open_stream(stack, other, url) for _ in range(MAX_STREAMS_PER_CLIENT)] == whole_share
        with contextlib.ExitStack() as extra:
            assert _open_stream(extra, local, url, wrong) == 503

        # The token holder, on the same address, still gets its whole share ...
        holder = [
            _open_stream(stack, local, url, BEARER),
            _open_stream(stack, local, url, token_in_query=TOKEN),  # the page's EventSource
            *(_open_stream(stack, local, url, {"X-Slime-Token": TOKEN}) for _ in range(MAX_STREAMS_PER_CLIENT - 2)),
        ]
        assert holder == whole_share
        with contextlib.ExitStack() as extra:  # ... and no more
            assert _open_stream(extra, local, url, BEARER) == 429


def _redis_calls(client: redis.Redis) -> int:
    """Data commands served so far (connection set-up and INFO itself not counted)."""
    skip = {"cmdstat_info", "cmdstat_hello", "cmdstat_client", "cmdstat_auth", "cmdstat_select", "cmdstat_ping"}
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in skip and not k.startswith("cmdstat_client|"))


def test_histogram_parameter_sweep_costs_no_extra_redis_work(tmp_path, monkeypatch):
    """Varying window/bins (and the rewards window, the steps limit) used to miss the cache and scan
    up to 5,000 samples inside Redis each time; now one snapshot serves every parameter."""
    monkeypatch.setattr(dashboard_reader, "ROWS_TTL_S", 120.0)  # the sweep must not outlive the TTL on a slow box
    monkeypatch.setattr(dashboard_reader, "STEPS_TTL_S", 120.0)
    server = LocalRedisServer(tmp_path / "redis", aof=False)
    try:
        buffer = TrajectoryStore.open(server.url, "sweep")
        _fill(buffer, 8)
        JobTelemetry(buffer.connection).record_step(0, {"reward_mean": 0.5})
        counter = redis.Redis.from_url(server.url)
        with ServerThread(create_app(server.url, "sweep")) as dash:
            base = dash.url
            before = _redis_calls(counter)
            first = httpx.get(f"{base}/api/histograms", params={"window": 1000, "bins": 20}).json()
            assert first["window"] == 16 and sum(first["response_length"]["counts"]) == 16
            httpx.get(f"{base}/api/steps").raise_for_status()
            warm = _redis_calls(counter)
            assert warm > before  # the first read did go to Redis
            for window in (1, 3, 7, 50, 333, 4999, 5000):
                for bins in (1, 2, 17, 100):
                    h = httpx.get(f"{base}/api/histograms", params={"window": window, "bins": bins}).json()
                    assert h["window"] == min(window, 16)
                assert httpx.get(f"{base}/api/rewards", params={"window": window}).status_code == 200
            for limit in (1, 5, 200, 500):
                assert httpx.get(f"{base}/api/steps", params={"limit": limit}).status_code == 200
            assert _redis_calls(counter) == warm  # 40 parameter sets later: not one more command
        buffer.close()
        counter.close()
    finally:
        server.stop()


def test_dashboard_process_gets_its_token_from_the_environment(buffer):
    """The job's driver starts `slime dashboard` as a child: the token is not on its command line."""
    proc = DashboardProcess(buffer.url, buffer.job, port=0, token=TOKEN)
    try:
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and b"--token" not in cmdline
        wait_for(lambda: _ok(proc.url + "api/summary"), 30, "the dashboard process to serve")
        assert httpx.post(proc.url + "api/control/resume", json={}).status_code == 401
        assert httpx.post(proc.url + "api/control/resume", headers=BEARER, json={}).status_code == 200
    finally:
        proc.stop()


def test_a_jobs_dashboard_on_a_taken_default_port_takes_a_free_one(buffer, tmp_path):
    """A second job with dashboard.enabled=true failed as a whole on 8377, taken by the first job's."""
    from slime.config import load_config
    from slime.dashboard.server import DashboardConfigError
    from slime.security import JobCredentials

    holder = socket.socket()
    with contextlib.suppress(OSError):  # already taken by someone else: taken either way
        holder.bind(("127.0.0.1", 8377))
        holder.listen(1)
    credentials = JobCredentials.create(tmp_path, own_redis=False)
    try:
        cfg = load_config(None, [f"job_name={buffer.job}", "dashboard.enabled=true"])
        dashboard = DashboardProcess.for_job(cfg, buffer.url, credentials, tmp_path)
        try:
            assert ":8377/" not in dashboard.url
            wait_for(lambda: _ok(dashboard.url + "api/summary"), 30, "the dashboard on its free port")
        finally:
            dashboard.stop()
        on_purpose = load_config(None, [f"job_name={buffer.job}", "dashboard.enabled=true", "dashboard.port=8377"])
        with pytest.raises(DashboardConfigError, match="8377"):
            DashboardProcess.for_job(on_purpose, buffer.url, credentials, tmp_path)
    finally:
        holder.close()


def test_dashboard_cli_refuses_argv_tokens_and_open_binds(redis_url):
    base = [sys.executable, "-m", "slime.cli", "dashboard", "--redis", redis_url, "--job", "sec-cli"]
    removed = subprocess.run(
        [*base, "--token", TOKEN, "--port", "0"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert removed.returncode == 2 and "--token was removed" in removed.stderr
    open_bind = subprocess.run(
        [*base, "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert open_bind.returncode == 2 and "token" in open_bind.stderr


def test_dashboard_cli_derives_its_token_from_a_run_secret(redis_url, tmp_path):
    """`slime dashboard --secret-file RUN/job.secret`: the token is the run's derived dashboard token."""
    from slime.security import JobCredentials

    credentials = JobCredentials.create(tmp_path, own_redis=False)
    token = credentials.token("dashboard")
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slime.cli",
            "dashboard",
            "--redis",
            redis_url,
            "--job",
            "sec-cli",
            "--port",
            str(port),
            "--secret-file",
            str(tmp_path / "job.secret"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    try:
        line, _ = _wait_for_line(proc, r"dashboard of job", 120)
        assert token not in line and credentials.secret not in line
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: _ok(url + "api/summary"), 30, "the dashboard to serve")
        assert httpx.post(url + "api/control/resume", json={}).status_code == 401
        assert httpx.post(url + "api/control/resume", json={}, headers={"X-Slime-Token": token}).status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        TrajectoryStore.open(redis_url, "sec-cli").delete_job()


def test_page_builds_no_markup_from_strings():
    """Static check: nothing the API returns can become markup in the page."""
    static = REPO / "slime" / "dashboard" / "static"
    for path in static.glob("*.js"):
        source = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in source, f"{path.name} uses {sink}"
    assert not re.search(r"\son[a-z]+\s*=", (static / "index.html").read_text()), "inline event handler in index.html"


HOSTILE = '<img src=x onerror="window.__pwned=(window.__pwned||0)+1">'


def _hostile_api(seen: list[tuple[str, str, str]]) -> FastAPI:
    """Serves the real page and its assets, and API answers whose strings are markup."""
    app = FastAPI()
    app.mount("/static", StaticFiles(packages=[("slime.dashboard", "static")]), name="static")
    statuses = ["pending", "running", "aborted", "completed", "truncated", "failed"]

    @app.middleware("http")
    async def record(request: Request, call_next):
        seen.append((request.url.path, request.url.query, request.headers.get("authorization", "")))
        return await call_next(request)

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return (REPO / "slime" / "dashboard" / "static" / "index.html").read_text()

    @app.get("/api/trajectories")
    def trajectories() -> dict:
        row = {
            "id": HOSTILE,
            "group_id": HOSTILE,
            "index": 0,
            "status": HOSTILE,
            "reward": None,
            "failure": HOSTILE,
            "response_length": 3,
            "max_new_tokens": 8,
            "min_version": None,
            "max_version": None,
            "version_span": None,
            "created_at": 0.0,
            "updated_at": 0.0,
            "age_s": 1.0,
        }
        return {"items": [row], "next_cursor": None, "scanned": 1}

    @app.get("/api/stream")
    def stream() -> Response:
        summary = {
            "job": HOSTILE,
            "policy_version": 1,
            "step": None,
            "total_steps": None,
            "paused": False,
            "oversample": None,
            "samples_by_status": {s: 0 for s in statuses},
            "groups": {"open": 0, "ready": 0, "trained": 0},
            "queues": {},
            "generated_tokens": 5,
            "tokens_per_s": 0.0,
            "staleness_max": 0,
            "staleness_mean": 0.0,
            "server_time": 1.0,
        }
        return Response(f"event: summary\ndata: {json.dumps(summary)}\n\n", media_type="text/event-stream")

    empty = {"edges": [], "counts": [], "n": 0, "mean": None, "p50": None, "p99": None}

    @app.get("/api/histograms")
    def histograms() -> dict:
        return {"window": 0, "response_length": empty, "version_span": empty, "reward": empty, "staleness": empty}

    @app.get("/api/engines")
    def engines() -> list:
        return [{"worker_id": HOSTILE, "busy_fraction": 0.5}]

    @app.get("/api/experts")
    def experts() -> dict:
        return {"available": False, "counts": [], "share": [], "reason": HOSTILE}

    @app.get("/api/events")
    def events() -> list:
        return [{"ts": 1.0, "kind": HOSTILE, "detail": {"by": HOSTILE}}]

    @app.get("/api/steps")
    def steps() -> list:
        return []

    return app


@pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs apt packages chromium and chromium-driver",
)
def test_page_shows_hostile_ids_as_text_and_keeps_the_token_out_of_urls():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    seen: list[tuple[str, str, str]] = []
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    with ServerThread(_hostile_api(seen)) as server:
        browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            browser.get(f"{server.url}/#token={TOKEN}")
            cells = lambda: browser.find_elements(By.CSS_SELECTOR, "#trajectory-table tbody td")  # noqa: E731
            wait_for(lambda: len(cells()) == 7, 30, "the hostile row in the table")
            wait_for(lambda: browser.find_element(By.ID, "job").text == HOSTILE, 30, "the hostile job name")
            wait_for(lambda: any(p == "/api/events" for p, _, _ in seen), 30, "the events to load")
            time.sleep(0.5)  # an injected onerror would have fired by now
            assert browser.execute_script("return window.__pwned") is None
            assert browser.find_elements(By.CSS_SELECTOR, "main img, header img") == []
            assert cells()[0].get_attribute("textContent") == HOSTILE
            assert browser.execute_script("return location.hash") == ""  # the token left the address bar
        finally:
            browser.quit()
    fetched = [(p, q, a) for p, q, a in seen if p.startswith("/api/") and p != "/api/stream"]
    assert fetched and all(a == f"Bearer {TOKEN}" and "token" not in q for p, q, a in fetched)
    assert any(p == "/api/stream" and f"token={TOKEN}" in q for p, q, _ in seen)
    assert all("token" not in q for p, q, _ in seen if p != "/api/stream")


# ================================================================================ reward server

REWARDS_PY = """
import time

def length(prompt, response, label=None):
    return float(len(response))

def slow(prompt, response, label=None):
    time.sleep(0.4)
    return 1.0
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "sec_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _runner(spec: str | dict, timeout_s: float = 10, max_concurrency: int = 2) -> RewardRunner:
    return RewardRunner(load_reward_spec(spec), timeout_s, max_concurrency, name=describe_spec(spec))


def _score(url: str, n: int = 1, headers: dict | None = None, **kwargs) -> httpx.Response:
    samples = [{"prompt": "p", "response": "abc"} for _ in range(n)]
    return httpx.post(f"{url}/score", json={"samples": samples}, headers=headers, timeout=30, **kwargs)


def test_reward_server_wants_its_token_on_score(rewards_file):
    with _runner(f"{rewards_file}:length") as runner, ServerThread(make_app(runner, token=TOKEN)) as server:
        assert _score(server.url).status_code == 401
        assert _score(server.url, headers={"Authorization": "Bearer not-the-token"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # loopback: reading its health is fine
        r = _score(server.url, headers=BEARER)
        assert r.status_code == 200 and r.json()["results"][0]["reward"] == 3.0
        assert _score(server.url, headers={"X-Slime-Token": TOKEN}).status_code == 200
        assert httpx.get(f"{server.url}/health").json()["scored"] == 2  # the refused ones ran nothing
    with _runner(f"{rewards_file}:length") as runner, ServerThread(make_app(runner)) as server:
        assert _score(server.url).status_code == 403  # no token configured: /score is off, not open


def test_reward_server_off_loopback_guards_every_route(rewards_file):
    with _runner(f"{rewards_file}:length") as runner:
        app = make_app(runner, token=TOKEN, bind_host="0.0.0.0")
        with ServerThread(app) as server:
            assert httpx.get(f"{server.url}/health").status_code == 401
            assert httpx.get(f"{server.url}/openapi.json").status_code == 401
            assert httpx.get(f"{server.url}/health", headers=BEARER).status_code == 200
            assert _score(server.url, headers=BEARER).status_code == 200


def _raw_post(port: int, path: str, declared: int, body: bytes, token: str) -> int:
    """The status a server answers to a body larger than it sends (a client that declares 30 MB)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {declared}\r\n\r\n".encode()
            + body
        )
        head = s.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])


def test_reward_server_refuses_huge_bodies(rewards_file):
    with _runner(f"{rewards_file}:length") as runner, ServerThread(make_app(runner, token=TOKEN)) as server:
        assert _raw_post(server.port, "/score", 30 << 20, b'{"samples": [', TOKEN) == 413
        # Streamed without a length: cut off once past the limit.
        chunks = (b'{"samples": [' + b'{"prompt": "p", "response": "' + b"a" * (1 << 20) + b'"},' for _ in range(6))
        r = httpx.post(
            f"{server.url}/score", content=chunks, headers={**BEARER, "Content-Type": "application/json"}, timeout=30
        )
        assert r.status_code == 413
        assert _score(server.url, headers=BEARER).status_code == 200


def test_reward_server_queue_is_bounded(rewards_file):
    with (
        _runner(f"{rewards_file}:slow", max_concurrency=2) as runner,
        ServerThread(make_app(runner, token=TOKEN, max_pending=4)) as server,
    ):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(_score, server.url, 4, BEARER)
            wait_for(lambda: httpx.get(f"{server.url}/health").json()["pending"] == 4, 10, "4 samples pending")
            flood = _score(server.url, 1, BEARER)
            assert flood.status_code == 429 and flood.headers["retry-after"]
            assert _score(server.url, 5, BEARER).status_code == 413  # can never fit: not worth retrying
            assert first.result().status_code == 200
        wait_for(lambda: httpx.get(f"{server.url}/health").json()["pending"] == 0, 10, "the queue to drain")
        assert _score(server.url, 1, BEARER).status_code == 200


def test_reward_client_sends_the_token(rewards_file, monkeypatch):
    with _runner(f"{rewards_file}:length") as runner, ServerThread(make_app(runner, token=TOKEN)) as server:
        without = make_reward_service(RewardConfig(mode="http", url=server.url, cache_size=0, max_retries=0), "sec")
        failure = without.submit("p", "abc").result(timeout=30).failure
        assert "401" in failure and "reward.token" in failure
        without.close()
        monkeypatch.setenv("SEC_TEST_REWARD_TOKEN", TOKEN)
        cfg = load_config(
            None,
            [
                "reward.mode=http",
                f"reward.url={server.url}",
                "reward.cache_size=0",
                "reward.token=${SEC_TEST_REWARD_TOKEN}",
            ],
        )  # a reference, resolved at load
        service = make_reward_service(cfg.reward, "sec")
        assert service.submit("p", "abc").result(timeout=30).reward == 3.0
        assert TOKEN not in service.name
        service.close()


def _judge_server(seen: list[str]) -> ServerThread:
    """An OpenAI-style judge whose verdicts never parse, so every sample fails with a message."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        seen.append(request.headers.get("authorization", ""))
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "no idea"}}]}

    return ServerThread(app)


def test_judge_api_key_never_shows(caplog, rewards_file):
    seen: list[str] = []
    with _judge_server(seen) as judge:
        user_url = judge.url.replace("http://", "http://judge-user:url-password-77@")
        spec = {
            "mix": [
                {
                    "fn": {"fn": "rewards.judge:llm_judge", "kwargs": {"url": judge.url, "api_key": SECRET_KEY}},
                    "weight": 1.0,
                },
                {"fn": {"fn": "rewards.judge:llm_judge", "kwargs": {"url": user_url}}, "weight": 0.0},
            ]
        }
        shown: list[str] = []
        # In a rollout worker (what it writes to Redis is the failure text) ...
        service = make_reward_service(RewardConfig(fn=spec, cache_size=0, timeout_s=10), "sec")
        result = service.submit("q", "a").result(timeout=30)
        assert result.failure and "JudgeParseError" in result.failure
        shown += [service.name, result.failure]
        service.close()
        # ... and behind the reward server: /health and each failure.
        with _runner(spec) as runner, ServerThread(make_app(runner, token=TOKEN)) as server:
            health = httpx.get(f"{server.url}/health").json()
            assert "***" in health["reward"] and "llm_judge" in health["reward"]
            reply = _score(server.url, headers=BEARER).json()["results"][0]
            assert "JudgeParseError" in reply["failure"]
            shown += [json.dumps(health), json.dumps(reply)]
        # A spec whose factory fails names its kwargs, redacted.
        with pytest.raises(RewardSpecError) as bad:
            load_reward_spec({"fn": "rewards.judge:llm_judge", "kwargs": {"url": "ftp://x", "api_key": SECRET_KEY}})
        shown += [str(bad.value)]
    assert f"Bearer {SECRET_KEY}" in seen  # the key does reach the judge ...
    for text in [*shown, caplog.text]:  # ... and nothing else
        assert SECRET_KEY not in text and "url-password-77" not in text, text


def _wait_for_line(proc: subprocess.Popen, pattern: str, timeout_s: float) -> tuple[str, list[str]]:
    lines: list[str] = []
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return line, lines
    raise AssertionError(f"no line matching {pattern!r}: {''.join(lines)}")


def test_reward_serve_cli_generates_a_private_token_and_refuses_open_binds(tmp_path, rewards_file):
    cmd = [sys.executable, "-m", "slime.cli", "reward-serve", f"{rewards_file}:length"]
    refused = subprocess.run(
        [*cmd, "--host", "0.0.0.0", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        env=_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
        timeout=120,
    )
    assert refused.returncode == 2 and "token" in refused.stderr and API_TOKEN_ENV in refused.stderr

    port = _free_port()

    def serve() -> subprocess.Popen:
        env = _env(XDG_CACHE_HOME=str(tmp_path / "cache"))
        return subprocess.Popen(
            [*cmd, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    proc = serve()
    try:
        line, printed = _wait_for_line(proc, r"generated a token in", 120)
        token_file = tmp_path / "cache" / "slime-april" / f"reward-serve-{port}.token"
        assert str(token_file) in line
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{url}/health"), 60, "reward-serve to answer")
        assert _score(url).status_code == 401
        assert _score(url, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline
        # A second server on the port by mistake: it wrote a new token over the file, then failed to
        # bind; the running server's clients got 401. Now it fails first and the file stays.
        second = subprocess.run(
            [*cmd, "--port", str(port)],
            capture_output=True,
            text=True,
            env=_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
            timeout=120,
        )
        assert second.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr
        assert "generated a token" not in second.stdout and token_file.read_text().strip() == token
        assert _score(url, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert token not in "".join(printed) + out

    # Restarted on its port, the server keeps the token its clients have.
    proc = serve()
    try:
        wait_for(lambda: _ok(f"{url}/health"), 60, "reward-serve to answer again")
        assert _score(url, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "generated a token" not in out and token_file.read_text().strip() == token

    # A token from the environment: nothing written, the same token works.
    port = _free_port()
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(XDG_CACHE_HOME=str(tmp_path / "cache2"), **{API_TOKEN_ENV: TOKEN}),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{url}/health"), 60, "reward-serve to answer")
        assert _score(url, headers=BEARER).status_code == 200
        assert not (tmp_path / "cache2").exists()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


# ================================================================================ OpenAI-compatible server


class HeldGenerator:
    """The real LocalGenerator, but each completion waits for `release` (requests stay in flight)."""

    def __init__(self, gen) -> None:
        self.gen = gen
        self.release = threading.Event()
        self.waiting = 0
        self.text_ids, self.chat_ids = gen.text_ids, gen.chat_ids

    def submit(self, ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> Future:
        held: Future = Future()
        self.waiting += 1

        def run() -> None:
            self.release.wait(60)
            held.set_result(self.gen.generate(ids, max_tokens, temperature, top_p))

        threading.Thread(target=run, daemon=True).start()
        return held


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    from slime.tools.openai_server import LocalGenerator

    gen = LocalGenerator(tiny_model_dir)
    yield gen
    gen.close()


def _complete(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "ab*2=", "max_tokens": 4, "temperature": 0, **body},
        timeout=60,
        **kwargs,
    )


def test_openai_server_bounds_every_input(generator):
    from slime.tools.openai_server import make_openai_app

    with ServerThread(make_openai_app(generator, "tiny", max_body_bytes=1 << 20)) as server:
        url = server.url
        for field, value in (
            ("max_tokens", 10**9),
            ("max_tokens", 0),
            ("temperature", 1e30),
            ("temperature", -1),
            ("top_p", 0),
            ("top_p", 7),
            ("prompt", "a" * 300_000),
        ):
            r = _complete(url, {field: value})
            assert r.status_code == 400, (field, value, r.text)
            assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]

        def chat(messages):
            return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": messages, "max_tokens": 4})

        r = chat([{"role": "user", "content": "x"}] * 1000)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = chat([{"role": "user", "content": "x" * 150_000}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
        assert _complete(url, {"prompt": "a" * (2 << 20)}).status_code == 413  # over the body limit
        r = _complete(url, {"prompt": "a" * 600})
        assert r.status_code == 400 and "reads at most 512" in r.text  # past the model's context
        r = _complete(url, {})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_openai_server_bounds_requests_in_flight(generator):
    from slime.tools.openai_server import make_openai_app

    held = HeldGenerator(generator)
    with ServerThread(make_openai_app(held, "tiny", max_in_flight=2)) as server:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(_complete, server.url, {}) for _ in range(2)]
            wait_for(lambda: held.waiting == 2, 20, "two requests in flight")
            busy = _complete(server.url, {})
            assert busy.status_code == 503 and busy.headers["retry-after"]
            held.release.set()
            assert [f.result().status_code for f in running] == [200, 200]
        assert _complete(server.url, {}).status_code == 200


def test_openai_server_guard(generator):
    from slime.tools.openai_server import make_openai_app

    with pytest.raises(ValueError, match="token"):
        make_openai_app(generator, bind_host="0.0.0.0")
    with ServerThread(make_openai_app(generator, "tiny", token=TOKEN, bind_host="0.0.0.0")) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert _complete(server.url, {}).status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers=BEARER).status_code == 200
        assert _complete(server.url, {}, headers=BEARER).status_code == 200
    with ServerThread(make_openai_app(generator, "tiny")) as server:  # loopback: generation is open, JSON only
        r = httpx.post(
            f"{server.url}/v1/completions", content=b'{"prompt": "ab"}', headers={"Content-Type": "text/plain"}
        )
        assert r.status_code == 415
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": "rebound.example"}).status_code == 421
        assert _complete(server.url, {}).status_code == 200
    # A loopback server given a token wants it for generation too: open, any local user could hold
    # every --max-in-flight slot and the judge's own requests got 503 (failed rewards).
    with ServerThread(make_openai_app(generator, "tiny", token=TOKEN)) as server:
        assert _complete(server.url, {}).status_code == 401
        assert _complete(server.url, {}, headers=BEARER).status_code == 200


def test_openai_server_cli_refuses_an_open_bind_before_loading(tmp_path):
    started = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "slime.tools.openai_server", str(tmp_path / "no-model"), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 2 and "token" in r.stderr and time.time() - started < 60
