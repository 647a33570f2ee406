"""Colocated on Ray (4 GPUs declared), rollout on CUDA, learner on CPU with more ranks than workers:
LearnerGroup makes a bundle per *worker* (shared_gpus counts no CPU rank), then places rank i in bundle i."""

PROBE = r"""
import json, os, sys
import ray
from slime.config import load_config
from slime.launch import launcher as launch_mod
from slime.launch.launcher import WorkerLaunch, start_rollout_worker
from slime.launch.ray_cluster import RayLauncher
from slime.learner import group as group_mod

class Probe:
    def __init__(self, *args, **kwargs):
        pass

    def gpus(self):
        return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")

group_mod.Learner = Probe
launch_mod.RolloutWorker = Probe
ray.init(num_cpus=2, num_gpus=4, include_dashboard=False)
cfg = load_config("examples/repeat_grpo.yaml", sys.argv[1:])
launcher = RayLauncher()
learner = group_mod.LearnerGroup(cfg, "m", "redis://x", None, launcher)
launch = WorkerLaunch("m", "redis://x", None, "probe")
workers = [
    start_rollout_worker(launcher, cfg, launch, i, shared_gpu=learner.worker_placement(i))
    for i in range(cfg.rollout.num_workers)
]
print(json.dumps({
    "ranks": ray.get([r.gpus.remote() for r in learner.ranks], timeout=60),
    "workers": ray.get([w.gpus.remote() for w in workers], timeout=60),
}))
"""

import os
import subprocess
import sys

args = [
    "learner.device=cpu",
    "rollout.device=cuda",
    "cluster.placement=colocated",
    "learner.num_ranks=2",
    "rollout.num_workers=1",
    "output_dir=/tmp/review_n_probe",
]
env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
print("rc", done.returncode)
print(done.stdout[-1500:])
print(done.stderr[-1500:])
