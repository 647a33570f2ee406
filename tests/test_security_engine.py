"""Attacks on the engines' network surface (issue 22), replayed against real servers on loopback.

Most run against one real ``python -m slime.engines.sglang.server`` process launched by
`SglangEngine.from_config` (token in its environment, --weights-dir, --update-group-hosts); each
attack must be refused and the server must then still serve an honest request. The engine-thread
failures are injected by hooks no HTTP request can reach: a monkeypatched engine in an in-process
server, and a wrapper script that patches the engine before running the server's main.
Also here: the JSON form of weight handles (`slime.weights.WeightHandle.to_json/from_json`).
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from safetensors.torch import save, save_file

from slime.config import load_config
from slime.engines.builtin import BuiltinEngine
from slime.engines.sglang.adapter import SglangEngine
from slime.engines.sglang.engine_thread import MAX_CONSECUTIVE_STEP_FAILURES, SglangProtocolServer
from slime.engines.sglang.processes import free_port
from slime.engines.sglang.server import create_app, guard_policy
from slime.model import load_model
from slime.security import API_TOKEN_ENV, auth_headers, new_secret
from slime.weights import CudaIpcTransport, SharedMemoryTransport, TensorMeta, WeightHandle, join_update_group
from tests.helpers import wait_for

TOKEN = new_secret()
AUTH = auth_headers(TOKEN)
PROMPT = [5, 12, 7, 30, 9, 14]
HONEST = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    """One rollout worker's launched server, as a job starts it: token by environment, its
    weights directory, the update-group address it announces; at most 2 running, 8 waiting."""
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path_factory.mktemp('secured')}",
            f"model.path={tiny_model_dir}",
            "rollout.engine=sglang",
            "rollout.max_running_requests=2",
            "sglang.launcher=slime",
            "sglang.request_timeout_s=60",
            "sglang.startup_timeout_s=120",
        ],
    )
    engine = SglangEngine.from_config(cfg, str(tiny_model_dir), 0, 0, api_token=TOKEN)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(secured) -> str:
    return secured.server_urls[0]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir).eval()


def post_json(url: str, body, **kwargs) -> httpx.Response:
    """POST ``body`` as JSON as it is, NaN included (httpx's json= refuses NaN)."""
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=30, **kwargs)


def greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def assert_still_serving(url: str) -> None:
    assert len(greedy(url)) == 4
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/health_generate", headers=AUTH, timeout=30).status_code == 200
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    assert info["step_failures"] == 0 and not info["paused"]


class _RunsCode:
    """Unpickling this runs a shell command: what the old /update_weights_from_tensor did."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_in_a_tensor_update_is_never_loaded(url, tmp_path):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps([("model.embed_tokens.weight", _RunsCode(marker))])).decode()
    for load_format in (None, "direct", "slime_weight_handle", "safetensors"):
        for headers, status in (({}, 401), (auth_headers("wrong"), 401), (AUTH, 400)):
            body = {"serialized_named_tensors": [payload], "load_format": load_format}
            r = httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=headers, timeout=30)
            assert r.status_code == status, (load_format, headers, r.text)
            if status == 400 and load_format is None:
                assert "never unpickles" in r.json()["message"] and "safetensors" in r.json()["message"]
    time.sleep(0.2)
    assert not marker.exists()
    assert_still_serving(url)


@pytest.mark.parametrize(
    "field, sampling",
    [
        ("top_k", {"top_k": 1e30}),
        ("top_k", {"top_k": 10**30}),
        ("top_k", {"top_k": 1.5}),
        ("top_k", {"top_k": True}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 100000}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": 1e30}),
        ("temperature", {"temperature": "hot"}),
        ("top_p", {"top_p": 0}),
        ("top_p", {"top_p": float("inf")}),
        ("max_new_tokens", {"max_new_tokens": 10**12}),
        ("max_new_tokens", {"max_new_tokens": -5}),
        ("max_new_tokens", {"max_new_tokens": 3.5}),
        ("stop_token_ids", {"stop_token_ids": [10**9]}),
        ("stop_token_ids", {"stop_token_ids": list(range(300))}),
        ("stop_token_ids", {"stop_token_ids": "7"}),
        ("ignore_eos", {"ignore_eos": "yes"}),
        ("min_p", {"min_p": float("nan")}),
    ],
)
def test_bad_sampling_values_answer_400_naming_the_field(url, field, sampling):
    for stream in (False, True):
        r = post_json(
            f"{url}/generate", {"input_ids": PROMPT, "sampling_params": sampling, "stream": stream}, headers=AUTH
        )
        assert r.status_code == 400 and field in r.json()["message"], r.text
    assert_still_serving(url)


@pytest.mark.parametrize(
    "field, body",
    [
        ("input_ids", {"input_ids": [1, 10**9]}),
        ("input_ids", {"input_ids": [1, -1]}),
        ("input_ids", {"input_ids": [1, 2.5]}),
        ("input_ids", {"input_ids": [1, True]}),
        ("input_ids", {"input_ids": []}),
        ("input_ids", {"input_ids": [[1, 2]] * 9}),  # a batch over 4 x max_running_requests
        ("rid", {"input_ids": [1, 2], "rid": "a\nb"}),
        ("rid", {"input_ids": [1, 2], "rid": "x" * 200}),
        ("logprob_start_len", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}),
        ("stream", {"input_ids": [1, 2], "stream": "yes"}),
    ],
)
def test_bad_prompts_answer_400_naming_the_field(url, field, body):
    r = httpx.post(f"{url}/generate", headers=AUTH, json=body, timeout=30)
    assert r.status_code == 400 and field in r.json()["message"], r.text
    assert_still_serving(url)


def test_a_cross_site_pause_is_refused(url):
    """A page can POST text/plain (or a form) without a CORS preflight: such a pause must not act."""
    done: dict = {}
    t = threading.Thread(
        target=lambda: done.update(
            httpx.post(
                f"{url}/generate",
                headers=AUTH,
                timeout=60,
                json={
                    "input_ids": PROMPT,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
                },
            ).json()
        )
    )
    t.start()
    wait_for(lambda: httpx.get(f"{url}/get_load").json()[0]["num_reqs"] == 1, 30, "the request to run")
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(f"{url}/pause_generation", content=b'{"mode": "abort"}', headers=headers)
        assert r.status_code == 415, r.text
    t.join(timeout=60)
    assert done["meta_info"]["finish_reason"]["type"] == "length"  # neither paused nor aborted
    assert_still_serving(url)


def test_a_foreign_host_header_is_refused(url):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as Host."""
    for method, path, body in (("GET", "/server_info", None), ("POST", "/generate", HONEST)):
        r = httpx.request(method, f"{url}{path}", json=body, headers={**AUTH, "Host": "evil.example"})
        assert r.status_code == 421, r.text
    assert_still_serving(url)


CONTROL_ROUTES = [
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"rid": "", "abort_all": True}),
    ("POST", "/flush_cache", {}),
    ("GET", "/flush_cache", None),
    ("GET", "/health_generate", None),  # it queues a generation
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["e30="], "load_format": "safetensors"}),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
    ),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("POST", "/destroy_weights_update_group", {}),
]


@pytest.mark.parametrize("method, path, body", CONTROL_ROUTES)
def test_control_routes_need_the_token(url, method, path, body):
    for headers in ({}, auth_headers("wrong"), {"X-Slime-Token": "wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
    r = httpx.request(method, f"{url}{path}", params={"token": TOKEN}, json=body, timeout=10)
    assert r.status_code == 401  # not in the query string: URLs end up in logs
    assert_still_serving(url)


def test_the_token_is_in_the_environment_not_the_command_line(secured):
    (proc,) = secured.processes
    cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline and b"--token" not in cmdline
    assert f"{API_TOKEN_ENV}={TOKEN}".encode() in Path(f"/proc/{proc.proc.pid}/environ").read_bytes().split(b"\0")
    assert TOKEN not in proc.log_path.read_text()


def test_disk_updates_load_only_under_the_weights_dir(url, secured, model, tmp_path):
    root = secured.weights_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({n: torch.zeros_like(p) for n, p in model.named_parameters()}, str(outside / "model.safetensors"))
    (root / "link").symlink_to(outside)  # a directory link out of the root
    (root / "file_link").mkdir()
    (root / "file_link" / "model.safetensors").symlink_to(outside / "model.safetensors")
    before = greedy(url)
    for path in (outside, root / "link", root / "file_link", root / ".." / "..", "/"):
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(path)}, headers=AUTH, timeout=30)
        assert r.status_code == 403 and "--weights-dir" in r.json()["message"], (path, r.text)
    assert greedy(url) == before  # nothing loaded
    inside = root / "v1"  # the job's own directory: loaded
    inside.mkdir()
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(inside / "model.safetensors"))
    r = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(inside), "weight_version": "3"},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == "3"
    assert_still_serving(url)


def test_update_groups_connect_only_to_announced_addresses(url):
    def init(**fields):
        body = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
            **fields,
        }
        return httpx.post(f"{url}/init_weights_update_group", json=body, headers=AUTH, timeout=90)

    started = time.time()
    for fields, word in (
        ({"master_address": "10.255.255.1"}, "--update-group-hosts"),
        ({"master_address": "evil.example"}, "--update-group-hosts"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 70000}, "master_port"),
        ({"world_size": 5000}, "world_size"),
        ({"rank_offset": 0}, "rank_offset"),
        ({"rank_offset": 2}, "rank_offset"),
        ({"backend": "mpi"}, "backend"),
        ({"group_name": "../x"}, "group_name"),
    ):
        r = init(**fields)
        assert r.status_code == 400 and word in r.text, (fields, r.text)
    assert time.time() - started < 5  # refused at once, no rendezvous attempted

    # one rendezvous at a time: a second one while the first waits for its master answers 409
    port = free_port()
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=init(master_port=port)))
    t.start()
    time.sleep(1.0)
    assert init(group_name="other").status_code == 409
    join_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 30)  # this test is the master (rank 0)
    t.join(timeout=60)
    assert first["r"].status_code == 200 and first["r"].json()["success"]
    r = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": "g"}, headers=AUTH)
    assert r.json()["success"]
    assert_still_serving(url)


def test_only_the_token_holder_aborts(url):
    events: list = []

    def stream():
        body = {
            "input_ids": PROMPT,
            "rid": "victim",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True},
        }
        with httpx.stream("POST", f"{url}/generate", headers=AUTH, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: events, 30, "the first event")
    for body in ({"rid": "victim"}, {"rid": "", "abort_all": True}):
        assert httpx.post(f"{url}/abort_request", json=body).status_code == 401
    t.join(timeout=60)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert_still_serving(url)


def test_an_oversized_body_is_refused(url):
    big = b'{"input_ids": [' + b"1, " * (3 << 20) + b"1]}"  # ~9 MiB, over the 8 MiB limit
    declared = httpx.post(
        f"{url}/generate", content=big, headers={"Content-Type": "application/json", **AUTH}, timeout=30
    )
    assert declared.status_code == 413  # refused on its Content-Length
    chunked = httpx.post(
        f"{url}/generate",
        content=iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
        headers={"Content-Type": "application/json", **AUTH},
        timeout=30,
    )
    assert chunked.status_code == 413  # no length given: refused once 8 MiB have arrived
    assert_still_serving(url)


def test_a_full_queue_answers_503(url):
    """At most 8 waiting requests here (4 x max_running_requests): a paused server fills up."""
    assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=AUTH).status_code == 200
    batch: dict = {}
    body = {"input_ids": [PROMPT] * 8, "sampling_params": {"max_new_tokens": 4}}
    t = threading.Thread(
        target=lambda: batch.update(r=httpx.post(f"{url}/generate", headers=AUTH, json=body, timeout=60))
    )
    t.start()
    try:
        wait_for(lambda: httpx.get(f"{url}/get_load").json()[0]["num_waiting_reqs"] == 8, 30, "8 waiting requests")
        r = httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=10)
        assert r.status_code == 503 and "max-queued-requests" in r.json()["message"]
    finally:
        httpx.post(f"{url}/continue_generation", json={}, headers=AUTH)
        t.join(timeout=60)
    assert batch["r"].status_code == 200 and len(batch["r"].json()) == 8
    assert_still_serving(url)


def test_json_weight_handles_are_checked_by_the_server(url, model, tmp_path):
    """The shm handle's segment must be a regular file of this user directly in /dev/shm, big
    enough for what the metas claim, and every name a tensor of the model with its shape."""
    name, param = next(iter(model.named_parameters()))
    transport = SharedMemoryTransport(f"slime_sectest{os.getpid()}", bucket_mb=1)
    link = Path(f"/dev/shm/slime_sectest{os.getpid()}_1_w0")
    secret = tmp_path / "secret"
    secret.write_bytes(b"\0" * param.numel() * 4)
    link.symlink_to(secret)
    before = greedy(url)
    try:
        good = transport.publish(5, [(name, param.detach())])

        def post(handle_json: str):
            body = {"serialized_named_tensors": [handle_json], "load_format": "slime_weight_handle"}
            return httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=AUTH, timeout=30)

        doc = json.loads(good.to_json())
        cases = {
            "symlink": {**doc, "buckets": [{"segment": link.name}]},
            "not_ours": {**doc, "buckets": [{"segment": "slime_x_1_w0/../../etc/passwd"}]},
            "unknown_name": {**doc, "metas": [{**doc["metas"][0], "name": "lm_head.evil"}]},
            "wrong_shape": {**doc, "metas": [{**doc["metas"][0], "shape": [1, doc["metas"][0]["nbytes"] // 4]}]},
            "past_the_end": {**doc, "metas": [{**doc["metas"][0], "offset": 1 << 20}]},
        }
        for case, bad in cases.items():
            r = post(json.dumps(bad))
            assert r.status_code == 400 and not r.json()["success"], (case, r.text)
        assert greedy(url) == before
        r = post(good.to_json())
        assert r.status_code == 200 and r.json()["success"], r.text
        assert httpx.get(f"{url}/model_info").json()["weight_version"] == "5"
        # safetensors bytes inline: the other pickle-free format
        payload = base64.b64encode(save({name: param.detach().clone()})).decode()
        body = {"serialized_named_tensors": [payload], "load_format": "safetensors", "weight_version": "6"}
        r = httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text
        body["serialized_named_tensors"] = [base64.b64encode(save({"evil": torch.zeros(3)})).decode()]
        r = httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "'evil' is not a tensor of this model" in r.json()["message"]
        # a CUDA IPC handle to a CPU engine is refused before anything is mapped
        cuda = _cuda_handle_json()
        r = post(cuda)
        assert r.status_code == 400 and "CUDA" in r.json()["message"]
    finally:
        link.unlink()
        transport.close()
    assert greedy(url) == before
    assert_still_serving(url)


def test_a_non_loopback_bind_without_a_token_does_not_start(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != API_TOKEN_ENV}
    port = free_port()
    started = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime.engines.sglang.server",
            "--model",
            str(tiny_model_dir),
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and API_TOKEN_ENV in out.stderr and "loopback" in out.stderr, out.stderr
    assert time.time() - started < 30  # refused before the model loads
    argv_token = subprocess.run(
        [sys.executable, "-m", "slime.engines.sglang.server", "--model", str(tiny_model_dir), "--token", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert argv_token.returncode == 2 and "--token" in argv_token.stderr  # no argv flag for a secret


# ---- the engine thread ---------------------------------------------------------------------------
class _ThreadedUvicorn:
    def __init__(self, app, port: int):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_the_engine_thread_survives_a_failing_step(model, monkeypatch):
    """A step that raises (injected: no request can do it now) fails the requests in it, resets the
    engine and the thread goes on; only repeated failures stop it, and then /health says why."""
    engine = BuiltinEngine(model, max_running_requests=4)
    server = SglangProtocolServer(engine)
    port = free_port()
    http = _ThreadedUvicorn(create_app(server, guard_policy(None, "127.0.0.1")), port)
    url = f"http://127.0.0.1:{port}"
    real_step = engine.step
    failing = {"left": 1}

    def step():
        if failing["left"] > 0:
            failing["left"] -= 1
            raise OverflowError("injected: Python int too large to convert to C long")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    try:
        r = httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=30)
        assert r.status_code == 500 and "engine step failed: OverflowError" in r.json()["message"]
        failing["left"] = 1
        with httpx.stream("POST", f"{url}/generate", headers=AUTH, json={**HONEST, "stream": True}, timeout=30) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])["meta_info"]["finish_reason"]
        assert last["type"] == "abort" and last["status_code"] == 500 and "OverflowError" in last["message"]
        assert len(greedy(url)) == 4 and server.thread.is_alive()  # reset and serving
        assert httpx.get(f"{url}/health").status_code == 200 and not engine.has_unfinished()

        failing["left"] = 10**6  # now every step fails: the thread stops after a few in a row
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=30).status_code == 500
        wait_for(lambda: not server.thread.is_alive(), 10, "the engine thread to stop")
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "failed in a row" in health.json()["message"]
        r = httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=10)
        assert r.status_code == 503 and "engine thread has stopped" in r.json()["message"]
    finally:
        http.stop()
        server.stop()


_DYING_SERVER = """
import sys
from slime.engines.builtin import BuiltinEngine

def broken(self, *args, **kwargs):
    raise OverflowError("injected: Python int too large to convert to C long")

BuiltinEngine.step = broken  # the step fails, and so does the reset after it: the thread stops
BuiltinEngine.abort = broken
from slime.engines.sglang.server import main
main(sys.argv[1:])
"""


def test_a_server_whose_engine_died_reports_it_and_exits_on_sigterm(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _DYING_SERVER,
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--torch-threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 120, "the server to start")
        with httpx.stream("POST", f"{url}/generate", headers=AUTH, json={**HONEST, "stream": True}, timeout=30) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "OverflowError" in lines[-2]  # the open stream ended
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and "resetting the engine failed too" in health.json()["message"]
        assert httpx.post(f"{url}/generate", headers=AUTH, json=HONEST, timeout=10).status_code == 503
        started = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.time() - started < 8
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


# ---- the JSON form of weight handles ---------------------------------------------------------------
def _fake_cuda_bucket(numel: int) -> tuple:
    """What `reduce_tensor` returns for a 1-D uint8 CUDA bucket (values made up: no GPU here)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor, (
        torch.Tensor,
        torch.Size([numel]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        0,
        b"\x01" * 64,
        numel + 512,
        512,
        False,
        b"/torch_1234_5678_9",
        3,
        b"\x02" * 64,
        True,
    )


def _cuda_handle_json() -> str:
    metas = [TensorMeta("model.embed_tokens.weight", "float32", (2, 4), 0, 0, 32)]
    return WeightHandle(7, "cuda_ipc", metas, [_fake_cuda_bucket(64)]).to_json()


def test_a_weight_handle_round_trips_through_json():
    transport = SharedMemoryTransport(f"slime_jsontest{os.getpid()}", bucket_mb=0.001)
    try:
        named = [("a", torch.randn(100)), ("b", torch.randn(3, 7).to(torch.bfloat16)), ("c", torch.arange(5))]
        shm = transport.publish(2, named)
        assert WeightHandle.from_json(shm.to_json()) == shm
        assert "pickle" not in shm.to_json() and all("/" not in b for b in shm.buckets)
    finally:
        transport.close()
    cuda = WeightHandle.from_json(_cuda_handle_json())
    rebuild, args = cuda.buckets[0]
    assert rebuild is _fake_cuda_bucket(1)[0] and args == _fake_cuda_bucket(64)[1]
    assert cuda.metas == [TensorMeta("model.embed_tokens.weight", "float32", (2, 4), 0, 0, 32)] and cuda.version == 7


def test_a_cuda_ipc_handle_is_rebuilt_from_checked_values_only(monkeypatch):
    """The receiver calls torch's rebuild_cuda_tensor with the plain values of the JSON (mocked:
    no GPU here) and views each tensor inside the rebuilt bucket."""
    calls = []

    def rebuild(*args):
        calls.append(args)
        return torch.arange(64, dtype=torch.uint8)

    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", rebuild)
    handle = WeightHandle.from_json(_cuda_handle_json())
    ((name, tensor),) = CudaIpcTransport().receive(handle)
    assert calls == [_fake_cuda_bucket(64)[1]] and name == "model.embed_tokens.weight"
    assert torch.equal(tensor, torch.arange(32, dtype=torch.uint8).view(torch.float32).view(2, 4))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=True), "version"),
        (lambda d: d.update(transport="file"), "transport"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["metas"][0].update(dtype="object"), "dtype"),
        (lambda d: d["metas"][0].update(shape=[-1, 8]), "shape"),
        (lambda d: d["metas"][0].update(shape=[2, 4.0]), "shape"),
        (lambda d: d["metas"][0].update(nbytes=33), "nbytes"),
        (lambda d: d["metas"][0].update(offset=2), "offset"),
        (lambda d: d["metas"][0].update(offset=64), "outside bucket"),
        (lambda d: d["metas"][0].update(bucket=1), "bucket"),
        (lambda d: d["metas"][0].update(name="a b"), "name"),
        (lambda d: d["metas"].append(dict(d["metas"][0])), "twice"),
        (lambda d: d["buckets"][0].update(handle="not base64!"), "base64"),
        (lambda d: d["buckets"][0].update(numel=10**6), "storage_size_bytes"),
        (lambda d: d["buckets"][0].update(device=-1), "device"),
        (lambda d: d["buckets"][0].update(event_sync_required=1), "event_sync_required"),
        (lambda d: d.update(buckets=[{"segment": "../../etc/passwd"}]), "segment"),
    ],
)
def test_a_malformed_cuda_ipc_handle_is_refused(change, message):
    doc = json.loads(_cuda_handle_json())
    change(doc)
    with pytest.raises(ValueError, match=message):
        WeightHandle.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "segment",
    [
        "../etc/passwd",
        "slime_x_1_w0/../../x",
        "/dev/shm/slime_x_1_w0",
        "other_1_w0",
        "slime_x_1_w",
        "slime_x 1_w0",
        "slime_x_1_w0\n",
    ],
)
def test_shm_segment_names_must_be_ours(segment):
    doc = {"version": 1, "transport": "shm", "metas": [], "buckets": [{"segment": segment}]}
    with pytest.raises(ValueError, match="segment"):
        WeightHandle.from_json(json.dumps(doc))


def test_generate_needs_the_token_of_a_server_that_has_one(url):
    """Open on loopback, any local user could fill a job's server's queue (2 running + 8 waiting
    here) and the job's next request got 503, failing its rollout worker."""
    for headers in ({}, auth_headers("wrong")):
        assert httpx.post(f"{url}/generate", json=HONEST, headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # liveness stays open for routers
    assert_still_serving(url)


def test_health_probes_arriving_together_share_one_generation(url):
    """A burst of /health_generate took one queue slot each: 800 of them filled the queue (2 running
    + 8 waiting here) and the job's own requests got 503."""
    answers: list[int] = []
    with httpx.Client(timeout=60) as client:
        burst = [
            threading.Thread(
                target=lambda: answers.append(client.get(f"{url}/health_generate", headers=AUTH).status_code)
            )
            for _ in range(40)
        ]
        for t in burst:
            t.start()
        r = client.post(f"{url}/generate", headers=AUTH, json=HONEST)
        for t in burst:
            t.join(timeout=60)
    assert r.status_code == 200 and answers == [200] * 40
    assert_still_serving(url)


def test_a_vanishing_temperature_is_greedy_as_in_sglang(url):
    """temperature 1e-45 overflowed logits / temperature: NaN probabilities, token 0 and a 500 on
    the non-finite logprob. SGLang samples greedily below its epsilon; so does this server."""
    body = {**HONEST, "return_logprob": True, "sampling_params": {"temperature": 1e-45, "max_new_tokens": 4}}
    r = httpx.post(f"{url}/generate", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy(url)
    assert all(math.isfinite(lp) for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"])
