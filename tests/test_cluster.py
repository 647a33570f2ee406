"""A job across two Ray nodes (deploy/local_cluster.py on this machine): the learner ranks on one
node, the rollout workers on the other, weights by the broadcast transport (gloo: the learner
stages, both workers' receives join every collective, the probe check of each engine after every
push); placement read from Ray's state API; nothing of the cluster left behind."""

from __future__ import annotations

import json
import os
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


def _start_cluster(env: dict) -> tuple[subprocess.Popen, str]:
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
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("address: "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("deploy/local_cluster.py did not print its address")


def test_learner_and_rollout_workers_on_different_nodes(tiny_model_dir, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cluster, address = _start_cluster(env)
    cluster_processes = psutil.Process(cluster.pid).children(recursive=True)
    try:
        job = subprocess.run(
            [
                sys.executable,
                "-m",
                "slime.cli",
                "train",
                "job_name=two-nodes",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"cluster.ray_address={address}",
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
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
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
