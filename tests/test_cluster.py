"""A job across two Ray nodes (deploy/local_cluster.py on this machine), submitted through Ray's Jobs
API (`slime submit`, followed with `slime logs --follow`, reported by `slime status`): the learner
ranks on one node, the rollout workers on the other, weights by the broadcast transport (gloo: the
learner stages, both workers' receives join every collective, the probe check of each engine after
every push); placement read from Ray's state API; a second submitted job stopped with `slime stop`;
nothing of the cluster or the jobs left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

PLACEMENT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="error")
from ray.util.state import list_actors
kinds = {n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes()}
print(json.dumps([[a.class_name, kinds.get(a.node_id)] for a in list_actors(limit=1000, detail=True)]))
"""


def _start_cluster(env: dict) -> tuple[subprocess.Popen, str, str]:
    """The cluster process, its GCS address and its dashboard (Jobs API) URL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "deploy" / "local_cluster.py"),
            "--node",
            "learner_node=2",
            "--node",
            "rollout_node=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    printed: dict[str, str] = {}
    deadline = time.time() + 120
    while time.time() < deadline and len(printed) < 2:
        line = proc.stdout.readline()
        if line.startswith(("address: ", "dashboard: ")):
            name, value = line.split()
            printed[name] = value
        if not line and proc.poll() is not None:
            break
    if len(printed) == 2:
        return proc, printed["address:"], printed["dashboard:"]
    proc.kill()
    raise RuntimeError("deploy/local_cluster.py did not print its address and dashboard")


def _slime(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _submit(env: dict, dashboard: str, *overrides: str) -> str:
    submitted = _slime(env, "submit", str(ROOT / "examples" / "repeat_grpo.yaml"), "--address", dashboard, *overrides)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    return re.match(r"submitted (raysubmit_\w+) ", submitted.stdout).group(1)


def _wait_for_status(env: dict, dashboard: str, job_id: str, wanted: str, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while True:
        status = _slime(env, "status", job_id, "--address", dashboard)
        assert status.returncode == 0, status.stderr
        if status.stdout.startswith(f"{job_id}: {wanted}"):
            return
        assert time.time() < deadline, status.stdout
        time.sleep(0.5)


def _processes_in(directory: Path) -> list[psutil.Process]:
    """Processes whose working directory is under `directory` (a job's redis-server runs in its run dir)."""
    found = []
    for process in psutil.process_iter():
        try:
            if Path(process.cwd()).is_relative_to(directory):
                found.append(process)
        except (psutil.Error, OSError):
            pass
    return found


def test_learner_and_rollout_workers_on_different_nodes(tiny_model_dir, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    cluster, address, dashboard = _start_cluster(env)
    cluster_processes = psutil.Process(cluster.pid).children(recursive=True)
    try:
        job_id = _submit(
            env,
            dashboard,
            "job_name=two-nodes",
            f"output_dir={tmp_path / 'two-nodes'}",
            f"model.path={tiny_model_dir}",
            "learner.num_ranks=2",
            "learner.resources_per_rank={learner_node: 1}",
            "rollout.resources_per_worker={rollout_node: 1}",
            "weights.transport=broadcast",
            "weights.bucket_mb=0.5",  # several buckets per push
            "weights.check_every=1",  # the probe check of every engine after every push
            "rollout.num_workers=2",  # both engines join every collective
            "steps=2",
            "rollout.batch_size=3",
            "rollout.n_samples_per_prompt=3",
            "rollout.max_new_tokens=24",
            "logging.progress=false",
        )
        # A second job, stopped once it runs (it would train for long): SIGTERM, the job ends.
        stopped_id = _submit(
            env, dashboard, "job_name=stopped", f"output_dir={tmp_path / 'stopped'}", f"model.path={tiny_model_dir}"
        )
        _wait_for_status(env, dashboard, stopped_id, "RUNNING")
        stop = _slime(env, "stop", stopped_id, "--address", dashboard)
        assert stop.returncode == 0 and "stop requested" in stop.stdout, stop.stdout + stop.stderr
        _wait_for_status(env, dashboard, stopped_id, "STOPPED")

        followed = _slime(env, "logs", job_id, "--address", dashboard, "--follow", timeout=300)
        tail = followed.stdout[-3000:]
        assert followed.returncode == 0, followed.stderr[-2000:]  # 1 when the job it follows failed
        assert tail.rstrip().endswith(f"{job_id}: SUCCEEDED (Job finished successfully.)"), tail
        _wait_for_status(env, dashboard, job_id, "SUCCEEDED", timeout_s=0)
        logs = _slime(env, "logs", job_id, "--address", dashboard)
        assert "cluster.ray_address=auto" in logs.stdout  # the entrypoint: the job joined the cluster
        assert re.search(r"^done: 2 steps, reward", logs.stdout, re.MULTILINE), logs.stdout[-3000:]
        assert len((tmp_path / "two-nodes" / "metrics.jsonl").read_text().splitlines()) == 2
        table = _slime(env, "status", "--address", dashboard).stdout
        assert re.search(rf"^{job_id} +SUCCEEDED .* two-nodes$", table, re.MULTILINE), table
        assert re.search(rf"^{stopped_id} +STOPPED .* stopped$", table, re.MULTILINE), table
        placed = subprocess.run(
            [sys.executable, "-c", PLACEMENT, address], env=env, capture_output=True, text=True, timeout=120
        )
        actors = json.loads(placed.stdout.strip().splitlines()[-1])
        assert sorted(node for kind, node in actors if kind == "Learner") == [["learner_node"]] * 2
        assert [node for kind, node in actors if kind == "RolloutWorker"] == [["rollout_node"]] * 2
    finally:
        cluster.terminate()
        cluster.wait(timeout=60)
    time.sleep(2)
    assert not [p for p in cluster_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not _processes_in(tmp_path)  # the jobs' redis-servers stopped with them
