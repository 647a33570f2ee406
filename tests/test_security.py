"""Security of what the job itself owns (docs/security.md): its Redis, its secret, the config it
writes, checkpoints, and no unsafe deserialisation anywhere in product code. The servers' attacks
are replayed in tests/test_security_engine.py and tests/test_security_services.py."""

from __future__ import annotations

import ast
import enum
import json
import os
import pickle
import re
import socket
import stat
import threading
import time
from pathlib import Path, PosixPath

import httpx
import pytest
import redis
import yaml

from slime.buffer import TrajectoryStore
from slime.buffer.redis_server import LocalRedisServer
from slime.config import dump_config, load_config
from slime.security import (
    JobCredentials,
    derive_token,
    redact,
    redact_url,
    write_private,
)

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("slime", "april", "rewards", "envs")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- no pickles, no unsafe loads -----------------------------------------------------------------
def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a Name/Attribute chain (``safetensors.torch`` is not ``torch``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _unsafe_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that deserialise code-bearing formats: pickle/dill/cloudpickle/marshal loads,
    torch.load without weights_only=True, yaml.load without SafeLoader, numpy load with pickles."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner_name = _dotted(node.func.value)
        attr = node.func.attr
        keywords = {k.arg: k.value for k in node.keywords}
        if owner_name in ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "_pickle") and attr in (
            "loads",
            "load",
            "Unpickler",
        ):
            found.append((node.lineno, f"{owner_name}.{attr}"))
        elif owner_name == "torch" and attr == "load":
            value = keywords.get("weights_only")
            if not (isinstance(value, ast.Constant) and value.value is True):
                found.append((node.lineno, "torch.load without weights_only=True"))
        elif owner_name == "yaml" and attr in ("load", "unsafe_load", "full_load", "load_all"):
            found.append((node.lineno, f"yaml.{attr} (use yaml.safe_load)"))
        elif owner_name in ("np", "numpy") and attr == "load":
            value = keywords.get("allow_pickle")
            if isinstance(value, ast.Constant) and value.value is True:
                found.append((node.lineno, "numpy.load(allow_pickle=True)"))
    return found


def test_no_product_code_deserialises_pickles_or_loads_checkpoints_unsafely():
    problems = []
    for folder in PRODUCT_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            problems += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _unsafe_calls(ast.parse(text))]
            # the same rule as text, for what the AST walk cannot see (getattr tricks, aliases)
            for i, line in enumerate(text.splitlines(), 1):
                code = line.split("#", 1)[0]
                if "pickle.loads(" in code or (
                    re.search(r"(?<![\w.])torch\.load\(", code) and "weights_only=True" not in code
                ):
                    problems.append(f"{path.relative_to(ROOT)}:{i}: {code.strip()}")
    assert not problems, "unsafe deserialisation in product code:\n" + "\n".join(sorted(set(problems)))


def test_the_checker_catches_what_it_must():
    bad = ast.parse(
        "import pickle, torch, yaml\n"
        "pickle.loads(b'')\n"
        "torch.load('x')\n"
        "torch.load('x', weights_only=False)\n"
        "yaml.load('a')\n"
        "torch.load('x', weights_only=True)\n"
        "yaml.safe_load('a')\n"
        "safetensors.torch.load(b'')\n"
    )
    assert [line for line, _ in _unsafe_calls(bad)] == [2, 3, 4, 5]


class _WritesMarker:
    """A pickle whose loading runs code: it creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_cannot_run_code(tiny_model_dir, redis_url, tmp_path):
    import torch

    from slime.learner import Learner
    from slime.learner.sharding import CheckpointError

    cfg = load_config(None, ["job_name=ckpt-attack", f"output_dir={tmp_path}"])
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    learner.save(str(tmp_path / "ckpt"))
    learner.load(str(tmp_path / "ckpt"))  # an honest checkpoint loads
    marker = tmp_path / "pwned"
    state = torch.load(tmp_path / "ckpt" / "learner_state.pt", weights_only=True)
    state["version"] = _WritesMarker(marker)
    with open(tmp_path / "ckpt" / "learner_state.pt", "wb") as f:
        pickle.dump(state, f)
    with pytest.raises(CheckpointError, match="cannot load checkpoint .*UnpicklingError") as raised:
        learner.load(str(tmp_path / "ckpt"))
    assert isinstance(raised.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()
    learner.close()
    TrajectoryStore.open(redis_url, "ckpt-attack").delete_job()


class _EnumsByName(pickle.Pickler):
    """Pickles Enum members as getattr(EnumClass, "NAME"), as Python 3.11.2 (Debian 12) does for every
    Enum: a sharded checkpoint index written there could not be loaded."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _AsksForAMethod:
    def __reduce__(self):
        return (getattr, (PosixPath, "write_text"))  # PosixPath itself is allowed (the index holds one)


def test_a_sharded_checkpoint_index_with_enums_by_name_loads_and_no_other_getattr_does(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from slime.learner.sharding import _MetadataCheckedReader

    saved = {"w": torch.arange(6.0).reshape(2, 3), "rng": torch.get_rng_state()}
    dcp.save(saved, checkpoint_id=str(tmp_path))  # one process, no process group
    index = tmp_path / ".metadata"
    by_value = pickle.loads(index.read_bytes())
    with open(index, "wb") as f:
        _EnumsByName(f).dump(by_value)
    assert b"getattr" in index.read_bytes()
    read = _MetadataCheckedReader(str(tmp_path)).read_metadata()
    assert read.state_dict_metadata == by_value.state_dict_metadata
    loaded = {"w": torch.zeros(2, 3), "rng": torch.zeros_like(saved["rng"])}
    dcp.load(loaded, checkpoint_id=str(tmp_path), storage_reader=_MetadataCheckedReader(str(tmp_path)))
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["rng"], saved["rng"])

    # getattr on anything but an Enum class's member is refused: it would hand out a method to call.
    with open(index, "wb") as f:
        pickle.dump(_AsksForAMethod(), f)
    with pytest.raises(pickle.UnpicklingError, match="write_text.*not an Enum member"):
        _MetadataCheckedReader(str(tmp_path)).read_metadata()


# ---- the job's Redis -------------------------------------------------------------------------------
def test_job_redis_needs_its_password_and_refuses_file_and_module_commands(tmp_path):
    data_dir = tmp_path / "redis"
    password = derive_token("a job secret", "redis")
    with LocalRedisServer(data_dir, aof=True, password=password) as server:
        anonymous = redis.Redis.from_url(server.url, socket_timeout=5)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anonymous.set("slime:x", "1")
        wrong = redis.Redis.from_url(server.url, password="guess", socket_timeout=5)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            wrong.ping()

        client = redis.Redis.from_url(server.url, password=password, socket_timeout=5)
        # The classic Redis-to-RCE moves, even with the password: write a file where we choose,
        # load a module, crash or stall the server, replicate from an attacker's server.
        for attack in (
            ["CONFIG", "SET", "dir", str(tmp_path)],
            ["CONFIG", "GET", "requirepass"],
            ["MODULE", "LOAD", "/tmp/evil.so"],
            ["DEBUG", "SEGFAULT"],
            ["REPLICAOF", "127.0.0.1", "1"],
            ["SLAVEOF", "127.0.0.1", "1"],
        ):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*attack)
        # ... and the server still serves the job.
        buffer = TrajectoryStore.open(server.url, "secured", password=password)
        gid = buffer.add_group([1, 2, 3], 2, 8, {})
        assert buffer.get_group(gid)
        assert password.encode() not in Path(f"/proc/{server._process.pid}/cmdline").read_bytes()
        assert "password" not in repr(buffer) and password not in repr(buffer)
        time.sleep(1.2)  # appendfsync everysec: let the AOF reach the disk
        assert _mode(data_dir) == 0o700
        files = [p for p in data_dir.rglob("*") if p.is_file()]
        assert any("appendonly" in p.name for p in files)
        for path in files:
            assert _mode(path) == 0o600, path


def test_a_buffer_pickled_for_an_actor_keeps_its_password(tmp_path):
    with LocalRedisServer(tmp_path / "redis", aof=False, password="pw-for-actors") as server:
        buffer = TrajectoryStore.open(server.url, "pickled", password="pw-for-actors")
        copy = pickle.loads(pickle.dumps(buffer))  # what Ray does with an actor argument
        assert copy.redis.ping()


# ---- secrets, config.yaml ----------------------------------------------------------------------------
def test_job_secret_file_is_private_and_service_tokens_are_independent(tmp_path):
    creds = JobCredentials.create(tmp_path, own_redis=True)
    assert _mode(tmp_path / "job.secret") == 0o600
    assert JobCredentials.read(tmp_path) == creds
    tokens = {creds.token("dashboard"), creds.token("sglang"), creds.redis_password, creds.secret}
    assert len(tokens) == 4  # knowing the dashboard token tells nothing of Redis's password
    assert creds.secret not in repr(creds) and creds.redis_password not in repr(creds)
    assert JobCredentials.create(tmp_path / "other", own_redis=False).redis_password is None


def test_written_config_keeps_references_and_hides_literal_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sk-live-0123456789")
    monkeypatch.setenv("DASH_TOKEN_FOR_TEST", "dashboard-token-abcdef")
    source = tmp_path / "job.yaml"
    source.write_text(
        yaml.safe_dump(
            {
                "dashboard": {"token": "${DASH_TOKEN_FOR_TEST}"},
                "reward": {
                    "fn": {
                        "fn": "rewards.judge:judge_reward",
                        "kwargs": {
                            "api_key": "${JUDGE_KEY_FOR_TEST}",
                            "password": "hunter2-literal",
                            "model": "judge-7b",
                            "max_tokens": 64,
                        },
                    }
                },
                "buffer": {"url": "redis://:redis-pass-literal@10.0.0.5:6379/0"},
            }
        )
    )
    cfg = load_config(source, ["reward.token=reward-token-literal"])
    assert cfg.dashboard.token == "dashboard-token-abcdef"  # resolved for the job itself
    assert cfg.reward.fn["kwargs"]["api_key"] == "sk-live-0123456789"

    written = tmp_path / "run" / "config.yaml"
    dump_config(cfg, written)
    text = written.read_text()
    assert _mode(written) == 0o600
    for secret in (
        "sk-live-0123456789",
        "dashboard-token-abcdef",
        "hunter2-literal",
        "redis-pass-literal",
        "reward-token-literal",
    ):
        assert secret not in text
    data = yaml.safe_load(text)
    assert data["dashboard"]["token"] == "${DASH_TOKEN_FOR_TEST}"
    assert data["reward"]["fn"]["kwargs"]["api_key"] == "${JUDGE_KEY_FOR_TEST}"
    assert data["reward"]["fn"]["kwargs"]["model"] == "judge-7b"  # not a secret: kept
    assert data["reward"]["fn"]["kwargs"]["max_tokens"] == 64
    assert data["buffer"]["url"] == "redis://:***@10.0.0.5:6379/0"
    # the written config loads again with the references resolved from the environment
    again = load_config(written, ["buffer.url=null", "reward.token=null"])
    assert again.reward.fn["kwargs"]["api_key"] == "sk-live-0123456789"


def test_unset_reference_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    source = tmp_path / "job.yaml"
    source.write_text("dashboard:\n  token: ${NOT_SET_ANYWHERE}\n")
    with pytest.raises(ValueError, match=r"dashboard\.token: environment variable NOT_SET_ANYWHERE is not set"):
        load_config(source)


def test_a_runs_config_yaml_keeps_its_column_names_and_runs_again(tmp_path):
    """data.prompt_key and its kin name dataset columns: config.yaml must keep them (they once
    came out as `***`, so the run's own config.yaml did not load the data)."""
    from slime.config import dump_config

    cfg = load_config(None, ["data.prompt_key=question", "data.label_key=answer"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert (again.data.prompt_key, again.data.label_key, again.data.task_key) == ("question", "answer", "task")


def test_redaction_keeps_ordinary_fields():
    data = {
        "max_new_tokens": 64,
        "tokens_per_s": 1.0,
        "api_key": "k",
        "dashboard_token": "t",
        "token": "x",
        "stop": ["a"],
        "url": "http://user:pw@host/x",
        "kwargs": {"Authorization": "Bearer y", "model": "m"},
    }
    assert redact(data) == {
        "max_new_tokens": 64,
        "tokens_per_s": 1.0,
        "api_key": "***",
        "dashboard_token": "***",
        "token": "***",
        "stop": ["a"],
        "url": "http://user:***@host/x",
        "kwargs": {"Authorization": "***", "model": "m"},
    }
    assert redact_url("redis://10.0.0.1:6379/0") == "redis://10.0.0.1:6379/0"


def test_write_private_never_exposes_the_file(tmp_path):
    path = write_private(tmp_path / "deep" / "token", "abc")
    assert _mode(path) == 0o600 and path.read_text() == "abc"
    os.chmod(path, 0o644)
    write_private(path, "def")  # rewriting tightens it again
    assert _mode(path) == 0o600 and path.read_text() == "def"


# ---- a whole job with its own Redis ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_job_with_its_own_redis_runs_secured_end_to_end(ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """No buffer.url: the job's redis-server has a password that only the job's processes know,
    the dashboard child reads the buffer with it and its control token is in a 0600 file."""
    from slime.train import train

    monkeypatch.setenv("E2E_JUDGE_KEY", "sk-e2e-not-for-files")
    port = _free_port()
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "job_name=secured",
            f"output_dir={out}",
            f"model.path={tiny_model_dir}",
            "steps=24",  # long enough for the watcher's dashboard checks on a fast machine (12 missed them once)
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=16",
            "data.num_generated=32",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "dashboard.enabled=true",
            f"dashboard.port={port}",
            "env.kwargs.api_key=${E2E_JUDGE_KEY}",
        ],
    )
    seen: dict[str, object] = {}

    def probe_redis(deadline: float) -> None:
        """As soon as the job's redis-server is up: does it serve a client without the password?
        (First, before the dashboard checks: a fast job can end, and stop its server, early.)"""
        while time.time() < deadline and "redis_anonymous" not in seen:
            try:
                redis_port = json.loads((out / "redis" / "server.json").read_text())["port"]
                redis.Redis(port=redis_port, socket_timeout=5).get("slime:secured:policy_version")
                seen["redis_anonymous"] = "served"
            except (redis.AuthenticationError, redis.ResponseError):
                seen["redis_anonymous"] = "refused"
            except (OSError, ValueError, KeyError, redis.RedisError) as exc:
                seen["redis_probe_error"] = repr(exc)  # not written yet, or not listening yet
                time.sleep(0.05)

    def watch() -> None:
        deadline = time.time() + 240
        probe_redis(deadline)
        while time.time() < deadline and "summary" not in seen:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/summary", timeout=5)
                if r.status_code == 200:  # all three answers from one live dashboard, or none
                    token = (out / "dashboard.token").read_text().strip()
                    no_token = httpx.post(f"http://127.0.0.1:{port}/api/control/resume", json={}, timeout=5)
                    with_token = httpx.post(
                        f"http://127.0.0.1:{port}/api/control/resume",
                        json={},
                        headers={"Authorization": f"Bearer {token}"},
                        timeout=5,
                    )
                    seen.update(no_token=no_token.status_code, with_token=with_token.status_code, summary=r.json())
            except (httpx.HTTPError, OSError) as exc:
                seen["dashboard_error"] = repr(exc)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    history = train(cfg)
    watcher.join(timeout=30)
    assert len(history) == 24 and history[-1]["policy_version"] == 24

    assert "summary" in seen, f"the dashboard never served the job's buffer: {seen}"
    assert seen["no_token"] == 401 and seen["with_token"] == 200
    assert seen.get("redis_anonymous") == "refused", seen
    for name in ("job.secret", "dashboard.token", "config.yaml"):
        assert _mode(out / name) == 0o600, name
    assert _mode(out / "redis") == 0o700
    assert "sk-e2e-not-for-files" not in (out / "config.yaml").read_text()
    # The job's server is gone now; over its AOF a server with another password still holds the data.
    with LocalRedisServer(out / "redis", password="inspector") as server:
        assert (
            TrajectoryStore.open(server.url, "secured", password="inspector").counts()["groups_trained"] == 48
        )  # 24 steps x 2 groups


_RAY_HEAD = """
import json, sys
from slime.security import JobCredentials
from slime.launch.ray_cluster import ray_token_auth

assert ray_token_auth(JobCredentials.read(sys.argv[1], own_redis=False), None)  # as the job, before `import ray`
import ray
ctx = ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="error")
print(json.dumps({"gcs": ctx.address_info["gcs_address"]}), flush=True)
sys.stdin.read()  # until the test closes our stdin
ray.shutdown()
"""

_RAY_CLIENT = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="error")
print("RAN", ray.get(ray.remote(lambda: 6 * 7).remote()))
"""


@pytest.mark.slow
def test_the_jobs_own_ray_refuses_clients_without_its_token(tmp_path):
    """A local Ray listens on every interface; without the job's token nobody can join it and run code."""
    import subprocess
    import sys

    creds = JobCredentials.create(tmp_path, own_redis=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    head = subprocess.Popen(
        [sys.executable, "-c", _RAY_HEAD, str(tmp_path)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        gcs = json.loads(head.stdout.readline())["gcs"]

        def client(extra: dict[str, str]) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-c", _RAY_CLIENT, gcs],
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=120,
            )

        # A guess (no token: the same). Ray retries a refused connection once a second, 20 times by
        # default; two tries show the refusal as well.
        refused = client({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 43, "RAY_NUM_REDIS_GET_RETRIES": "2"})
        assert refused.returncode != 0 and "RAN" not in refused.stdout
        honest = client({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": creds.token("ray")})
        assert "RAN 42" in honest.stdout, honest.stderr[-2000:]
    finally:
        head.stdin.close()
        head.wait(timeout=60)
