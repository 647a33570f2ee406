"""Experiment tracking through one logger (slime/tracking.py, docs/tracking.md), against real
backends: an MLflow tracking server on loopback read back through its client, W&B offline runs read
back from their files, an MLflow server that is not there or goes away mid-run. The config a run
hands over holds a judge's api_key and a URL password: neither may reach a backend or the output."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime.config import JobConfig, LoggingConfig, MlflowConfig, WandbConfig, config_for_display
from slime.metrics import MetricsLogger
from slime.tracking import (
    MLFLOW_MAX_NAME,
    MLFLOW_MAX_PARAM_VALUE,
    MLFLOW_PARAMS_PER_BATCH,
    config_params,
    missing_package_message,
    mlflow_name,
    require_packages,
)

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")

SECRET = "sk-THE-SECRET-123"  # a judge's api_key in reward.fn's kwargs
PASSWORD = "pw-URL-SECRET-456"  # in the MLflow tracking URI (the test server ignores credentials)
QUIET = {"tensorboard": False, "plot": False, "progress": False}
STEPS = {
    0: {"reward_mean": 0.25, "buffer": {"groups_ready": 3}, "pass@k": 0.5, "loss": float("nan")},
    1: {"reward_mean": 0.5, "buffer": {"groups_ready": 4}, "pass@k": 0.75, "loss": 1.5},
    2: {"reward_mean": 0.75, "buffer": {"groups_ready": 5}, "pass@k": 1.0, "loss": 1.25},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_config(logging: LoggingConfig) -> tuple[JobConfig, dict]:
    """A JobConfig whose reward kwargs hold a secret, and what the job hands the logger."""
    cfg = JobConfig(reward={"fn": {"fn": "rewards.rule:exact_match", "kwargs": {"api_key": SECRET}}}, logging=logging)
    return cfg, config_for_display(cfg)


class MlflowServer:
    """`mlflow server` on a loopback port with a SQLite store, in a session of its own (killed as a group)."""

    def __init__(self, root: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--workers", "1", "--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
        cmd += ["--default-artifact-root", str(root / "artifacts")]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://slime:{PASSWORD}@")


def _jsonl_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_mlflow_run_holds_every_step_and_the_config_without_secrets(mlflow_server, tmp_path, capsys):
    ml = MlflowConfig(tracking_uri=_with_password(mlflow_server.url), experiment="tracking-tests")
    cfg, shown = _job_config(LoggingConfig(**QUIET, mlflow=ml))
    logger = MetricsLogger(tmp_path, cfg.logging, 3, config={**shown, "notes": "x" * 7000})
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()

    client = mlflow.tracking.MlflowClient(mlflow_server.url)
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "tracking-tests"
    for key, name in [
        ("reward_mean", "reward_mean"),
        ("buffer/groups_ready", "buffer/groups_ready"),
        ("pass@k", "pass_k"),
    ]:
        history = client.get_metric_history(run.info.run_id, name)
        expected = {step: float(logger.history[step][key]) for step in STEPS}
        assert {m.step: m.value for m in history} == expected, name
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step: m.value for m in loss} == {1: 1.5, 2: 1.25}  # the NaN of step 0 is skipped

    params = run.data.params
    assert len(params) > MLFLOW_PARAMS_PER_BATCH  # logged in batches
    assert params["reward.fn.kwargs.api_key"] == "***"
    assert params["reward.fn.fn"] == "rewards.rule:exact_match"
    assert params["rollout.batch_size"] == str(cfg.rollout.batch_size)
    assert params["logging.mlflow.tracking_uri"] == mlflow_server.url.replace("http://", "http://slime:***@")
    assert len(params["notes"]) == MLFLOW_MAX_PARAM_VALUE and params["notes"].endswith("...")
    for key, value in params.items():
        assert SECRET not in value and PASSWORD not in value, key
    out = capsys.readouterr().out
    assert f"mlflow: run {run.info.run_id}" in out and PASSWORD not in out and "tracking:" not in out


@pytest.mark.timeout(120)
def test_a_resumed_run_continues_its_mlflow_run_and_a_fresh_one_starts_anew(mlflow_server, tmp_path, capsys):
    logging = LoggingConfig(**QUIET, mlflow=MlflowConfig(tracking_uri=mlflow_server.url))
    first = MetricsLogger(tmp_path, logging, 4, config={"seed": 1})
    for step in (0, 1, 2):
        first.log(step, {"reward_mean": step / 10})
    first.close()
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()

    resumed = MetricsLogger(tmp_path, logging, 4, start_step=2, config={"seed": 2, "extra": "new"})
    for step in (2, 3):
        resumed.log(step, {"reward_mean": step / 10 + 0.5})
    resumed.close()
    client = mlflow.tracking.MlflowClient(mlflow_server.url)
    assert (tmp_path / "mlflow_run_id").read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"seed": "1", "extra": "new"}  # MLflow params keep their first value
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean"))
    assert history == [(0, 0.0), (1, 0.1), (2, 0.2), (2, 0.7), (3, 0.8)]  # the redone step 2 has both
    assert f"mlflow: continuing run {run_id}" in capsys.readouterr().out

    fresh = MetricsLogger(tmp_path, logging, 1)
    fresh.close()
    assert (tmp_path / "mlflow_run_id").read_text().strip() != run_id


@pytest.mark.timeout(60)
def test_an_mlflow_server_that_is_not_there_never_stops_the_job(tmp_path, capsys):
    port = _free_port()  # nothing listens there
    logging = LoggingConfig(**QUIET, mlflow=MlflowConfig(tracking_uri=f"http://slime:{PASSWORD}@127.0.0.1:{port}"))
    started = time.monotonic()
    logger = MetricsLogger(tmp_path, logging, 3, config={"reward": {"kwargs": {"api_key": SECRET}}})
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()
    assert time.monotonic() - started < 15
    assert _jsonl_steps(tmp_path) == [0, 1, 2]
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "mlflow" in line]
    assert len(said) == 1, out
    assert said[0].startswith(f"tracking: mlflow at http://slime:***@127.0.0.1:{port} failed at start (")
    assert "ConnectionError" in said[0] and "it is off for the rest of this run" in said[0]
    assert PASSWORD not in out and SECRET not in out


@pytest.mark.timeout(120)
def test_an_mlflow_server_that_goes_away_mid_run_is_said_once(tmp_path, capsys):
    (tmp_path / "server").mkdir()
    (tmp_path / "run").mkdir()
    server, run_dir = MlflowServer(tmp_path / "server"), tmp_path / "run"
    logging = LoggingConfig(**QUIET, mlflow=MlflowConfig(tracking_uri=_with_password(server.url)))
    try:
        logger = MetricsLogger(run_dir, logging, 3, config={"seed": 1})
        logger.log(0, STEPS[0])
    finally:
        server.stop()
    started = time.monotonic()
    logger.log(1, STEPS[1])
    logger.log(2, STEPS[2])
    logger.close()
    assert time.monotonic() - started < 30  # the client's retries are bounded (MLFLOW_CLIENT_DEFAULTS)
    assert _jsonl_steps(run_dir) == [0, 1, 2]
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("tracking:")]
    assert len(said) == 1, out
    assert said[0].startswith(f"tracking: mlflow at http://slime:***@127.0.0.1:{server.port} failed at step 1 (")
    assert PASSWORD not in out


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's header, then LevelDB-log framing (32 KiB blocks, records
    of 7-byte header crc32/length/type, split FIRST/MIDDLE/LAST across blocks) around protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:  # not written yet
        return []
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    pos, whole, pending = 7, [], b""
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if pos + header + length > len(data):  # a record still being written
            break
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:
            whole.append(chunk)
        elif kind in (2, 3):
            pending = (b"" if kind == 2 else pending) + chunk
        elif kind == 4:
            whole.append(pending + chunk)
        else:
            break
    return [wandb_internal_pb2.Record.FromString(raw) for raw in whole]


def _finished_wandb_records(path: Path, timeout_s: float = 30.0) -> list:
    """The records of a finished run's .wandb file: W&B's service process may still be writing it
    when `finish()` returns, so wait for the exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path) if path.exists() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _wandb_history(records: list) -> dict[int, dict[str, float]]:
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            rows[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


@pytest.mark.timeout(180)
def test_wandb_offline_run_holds_every_step_and_no_secret(tmp_path, monkeypatch, capsys):
    for name in ("WANDB_MODE", "WANDB_SILENT", "WANDB_API_KEY"):  # the sink alone keeps it offline and quiet
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_free_port()}")  # any network call would fail fast
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wb"
    run_dir.mkdir()
    wb = WandbConfig(project="t", mode="offline", dir=str(wandb_dir), tags=["tests"])
    cfg, shown = _job_config(LoggingConfig(**QUIET, wandb=wb))
    logger = MetricsLogger(run_dir, cfg.logging, 3, config=shown)
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    [folder] = (wandb_dir / "wandb").glob("offline-run-*")
    records = _finished_wandb_records(folder / f"run-{run_id}.wandb")
    history = _wandb_history(records)
    assert sorted(history) == [0, 1, 2]
    for step in STEPS:
        logged = history[step]
        assert logged["reward_mean"] == STEPS[step]["reward_mean"]
        assert logged["buffer/groups_ready"] == STEPS[step]["buffer"]["groups_ready"]
        assert logged["pass@k"] == STEPS[step]["pass@k"]
    assert "loss" not in history[0] and history[1]["loss"] == 1.5  # NaN skipped
    [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (
        run_record.run_id == run_id and run_record.display_name == run_dir.name and list(run_record.tags) == ["tests"]
    )
    config = {
        item.key: json.loads(item.value_json) for r in records if r.HasField("config") for item in r.config.update
    }
    assert config["reward"]["fn"]["kwargs"]["api_key"] == "***"
    assert config["rollout"]["batch_size"] == cfg.rollout.batch_size
    for path in [*wandb_dir.rglob("*"), *run_dir.rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    out = capsys.readouterr().out
    assert f"wandb: offline run {run_id} in {folder}" in out and f"wandb sync {folder}" in out
    assert "tracking:" not in out

    time.sleep(1.1)  # W&B names an offline folder by the second it started and the id: a later second
    resumed = MetricsLogger(run_dir, cfg.logging, 4, start_step=3, config=shown)  # continues the same id
    resumed.log(3, {"reward_mean": 1.0})
    resumed.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    folders = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2
    history = _wandb_history(_finished_wandb_records(folders[1] / f"run-{run_id}.wandb"))
    assert sorted(history) == [3] and history[3]["reward_mean"] == 1.0


def test_tensorboard_gets_the_steps_and_the_config_and_a_resume_purges_the_redone_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging = LoggingConfig(plot=False, progress=False)
    first = MetricsLogger(tmp_path, logging, 3, config={"reward": {"kwargs": {"api_key": SECRET}}, "seed": 1})
    for step, metrics in STEPS.items():
        first.log(step, metrics)
    first.close()
    resumed = MetricsLogger(tmp_path, logging, 3, start_step=2, config={"seed": 2})  # redoes step 2
    resumed.log(2, {"reward_mean": 0.875})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 0.25), (1, 0.5), (2, 0.875)]
    assert [e.step for e in events.Scalars("loss")] == [1]  # step 0: NaN, skipped; step 2: purged, redone without
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("config/text_summary")]
    assert '"api_key": "***"' in texts[0] and '"seed": 2' in texts[1]
    for path in (tmp_path / "tensorboard").rglob("*"):
        assert SECRET.encode() not in path.read_bytes()


def test_metric_and_param_names_follow_mlflow_rules():
    assert mlflow_name("buffer/groups_ready") == "buffer/groups_ready"
    assert mlflow_name("pass@k (mean) v1.2") == "pass_k _mean_ v1.2"
    assert mlflow_name("/a//b/") == "a/b"
    assert mlflow_name("../up/./x") == "_./up/_/x"
    assert mlflow_name("ü:x") == "__x"
    assert len(mlflow_name("k" * 400)) == MLFLOW_MAX_NAME and mlflow_name("k" * 248 + "/.x") == "k" * 248 + "/_"
    params = config_params({"a": {"b": {"c": 1}, "empty": {}, "list": [1, "x"], "none": None}, "s": "text"})
    assert params == {"a.b.c": "1", "a.empty": "{}", "a.list": '[1, "x"]', "a.none": "null", "s": "text"}


def test_a_configured_backend_needs_its_package():
    assert missing_package_message("mlflow") == (
        "logging.mlflow is set but the mlflow package is not installed: pip install mlflow-skinny"
    )
    assert missing_package_message("wandb").endswith("pip install wandb")
    require_packages(LoggingConfig(wandb=WandbConfig(project="t"), mlflow=MlflowConfig(tracking_uri="sqlite:///x.db")))
