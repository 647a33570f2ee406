"""Code paths that run only on CUDA, checked on CPU where their logic allows (no GPU here)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from slime.learner import sharding


def test_a_cuda_learner_group_has_a_backend_for_the_cpu_tensors_gather_json_sends(monkeypatch):
    """gather_json (the ranks' stats after every update) gathers CPU tensors; a group of NCCL alone
    has no backend for them ("No backend type associated with device type cpu")."""
    seen: dict = {}
    monkeypatch.setattr(sharding.dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    sharding.init_group(0, 2, "127.0.0.1:1", torch.device("cuda"), 10.0)
    backends = BackendConfig(Backend(seen["backend"])).get_device_backend_map()
    assert backends.get("cuda") == "nccl"

    devices = []
    monkeypatch.setattr(sharding.dist, "get_world_size", lambda: 1)

    def all_gather(out, t):
        devices.append(t.device.type)
        for o in out:
            o.copy_(t)

    monkeypatch.setattr(sharding.dist, "all_gather", all_gather)
    assert sharding.gather_json({"a": 1}) == [{"a": 1}]
    assert devices and all(d in backends for d in devices), (devices, backends)


class _RecordingLauncher:
    name = "local"

    def __init__(self):
        self.options: dict = {}

    def cluster_resources(self):
        return {"CPU": 64.0, "GPU": 8.0}

    def actor(self, cls, *args, name, options):
        self.options[name] = options


def test_a_disaggregated_one_rank_learner_reserves_its_own_gpu():
    """Disaggregated, the engines reserve a GPU each and the job counts one more for the learner; a
    learner actor that reserves none sees every GPU of its node and runs on GPU 0, an engine's."""
    from slime.config import load_config
    from slime.learner.group import LearnerGroup, required_resources

    overrides = ["learner.device=cuda", "rollout.device=cuda", "rollout.num_workers=2"]
    disaggregated = load_config("examples/repeat_grpo.yaml", [*overrides, "cluster.placement=disaggregated"])
    assert required_resources(disaggregated)["GPU"] == 3
    launcher = _RecordingLauncher()
    LearnerGroup(disaggregated, "m", "redis://x", None, launcher)
    assert launcher.options["learner-0"]["num_gpus"] == 1.0

    colocated = load_config("examples/repeat_grpo.yaml", [*overrides, "cluster.placement=colocated"])
    launcher = _RecordingLauncher()
    LearnerGroup(colocated, "m", "redis://x", None, launcher)
    assert launcher.options["learner-0"]["num_gpus"] == 0


def test_a_tensor_update_for_a_tensor_parallel_sglang_server_has_a_payload_per_rank():
    """SGLang's TP rank r deserializes serialized_named_tensors[r]: with one entry, ranks >= 1 fail
    (IndexError) and the update is refused."""
    from slime.engines.sglang.adapter import SglangEngine

    engine = SglangEngine("http://127.0.0.1:9", tensor_parallel_size=2)
    try:
        body = engine._tensor_payload(1, [("w", torch.zeros(2))], builtin=False)
        assert len(body["serialized_named_tensors"]) == 2
        assert len(set(body["serialized_named_tensors"])) == 1
        assert len(engine._tensor_payload(1, [("w", torch.zeros(2))], builtin=True)["serialized_named_tensors"]) == 1
    finally:
        engine.close()


_PLACEMENT_PROBE = r"""
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
ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False)
launcher = RayLauncher()
found = []
for overrides in json.loads(sys.argv[1]):  # one Ray for every layout: each is placed, read, then freed
    cfg = load_config("examples/repeat_grpo.yaml", overrides)
    learner = group_mod.LearnerGroup(cfg, "m", "redis://x", None, launcher)
    launch = WorkerLaunch("m", "redis://x", None, "probe")
    workers = [
        start_rollout_worker(launcher, cfg, launch, i, shared_gpu=learner.worker_placement(i))
        for i in range(cfg.rollout.num_workers)
    ]
    found.append({
        "ranks": ray.get([r.gpus.remote() for r in learner.ranks], timeout=60),
        "workers": ray.get([w.gpus.remote() for w in workers], timeout=60),
    })
    for w in workers:
        ray.kill(w)
    learner.kill()
print(json.dumps(found))
"""


# The layouts the placement tests read: (learner device, learner ranks, rollout workers), all colocated.
PLACEMENT_LAYOUTS = [("cuda", 2, 2), ("cuda", 1, 3), ("cuda", 3, 1), ("cpu", 2, 1)]


@pytest.fixture(scope="module")
def placements(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, int], dict]:
    """Per layout, each learner rank's and rollout worker's GPU ids and CUDA_VISIBLE_DEVICES, as Ray
    (4 GPUs declared) gives them to actors placed as the job places its own; one Ray for all of them
    (a Ray start per layout cost the suite ~15 s each)."""
    import json
    import subprocess
    import sys

    layouts = [
        [
            f"learner.device={device}",
            "rollout.device=cuda",
            "cluster.placement=colocated",
            f"learner.num_ranks={ranks}",
            f"rollout.num_workers={workers}",
            f"output_dir={tmp_path_factory.mktemp('placement')}",
        ]
        for device, ranks, workers in PLACEMENT_LAYOUTS
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-c", _PLACEMENT_PROBE, json.dumps(layouts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(PLACEMENT_LAYOUTS, json.loads(done.stdout.strip().splitlines()[-1])))


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "workers"), [(2, 2), (1, 3), (3, 1)])
def test_colocated_ranks_and_engines_share_one_gpu_each_pair(placements, ranks, workers):
    """Colocated on Ray (4 GPUs declared): rank i and engine i are given the same GPU, and no two
    pairs the same one. Reserving no GPU, every engine saw all of them and ran on GPU 0."""
    got = placements[("cuda", ranks, workers)]
    rank_gpus = [ids for ids, _ in got["ranks"]]
    worker_gpus = [ids for ids, _ in got["workers"]]
    assert all(len(ids) == 1 for ids in rank_gpus + worker_gpus), got
    for i in range(min(ranks, workers)):
        assert rank_gpus[i] == worker_gpus[i], got
    pairs = [rank_gpus[i] if i < ranks else worker_gpus[i] for i in range(max(ranks, workers))]
    assert len({ids[0] for ids in pairs}) == max(ranks, workers), got
    for ids, visible in got["ranks"] + got["workers"]:
        assert visible == ids[0], got  # Ray narrows CUDA_VISIBLE_DEVICES to that GPU: "cuda" is it


def test_a_real_sglang_server_gets_the_weights_bucket_by_bucket_in_copies_of_its_own(monkeypatch):
    """torch refuses to pickle CUDA memory this process received from another (the learner's CUDA
    IPC weights: "Attempted to send CUDA tensor received from another process"): the adapter sends a
    real SGLang server copies it owns, one bucket at a time (the GPU holds one bucket's copy, not a
    second model), flushing the cache and naming the version with the last bucket only."""
    import base64
    import concurrent.futures
    import pickle

    import httpx

    from slime.engines.sglang.adapter import SglangEngine

    url = "http://127.0.0.1:9"
    engine = SglangEngine(url, bucket_mb=2048 / 2**20)  # 2 KiB buckets
    sent: list[dict] = []

    def send(requests):
        sent.extend(body for _, body in requests)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(
            [httpx.Response(200, json={"success": True}, request=httpx.Request("POST", u)) for u, _ in requests]
        )
        return done

    try:
        engine._builtin[url] = False  # a real SGLang server
        monkeypatch.setattr(engine, "_send", send)
        named = [(f"w{i}", torch.full((256,), float(i))) for i in range(3)]  # 1 KiB each
        engine._update_from_tensor(7, named)
    finally:
        engine.close()
    assert [b["flush_cache"] for b in sent] == [False, True]
    assert [b["weight_version"] for b in sent] == [None, "7"]
    got = [pickle.loads(base64.b64decode(b["serialized_named_tensors"][0])) for b in sent]
    assert [[n for n, _ in bucket] for bucket in got] == [["w0", "w1"], ["w2"]]
    assert all(torch.equal(t, torch.full((256,), float(n[1:]))) for bucket in got for n, t in bucket)


def test_a_tensor_parallel_engine_reserves_its_gpus_and_a_workers_sglang_servers_sit_side_by_side():
    """vLLM at tensor_parallel_size=2 needs two GPUs per worker; disaggregated, the worker reserved
    one (vLLM then saw one GPU and failed at start). Colocated it is not placed on one shared GPU.
    SGLang's servers of one worker start at --base-gpu-id j * tp (all sat on the first GPU)."""
    from slime.config import load_config
    from slime.engines.sglang.processes import launch_command
    from slime.launch.launcher import worker_resources
    from slime.learner.group import required_resources, shared_gpus

    base = ["learner.device=cuda", "rollout.device=cuda", "rollout.num_workers=2", "rollout.engine=vllm"]
    tp2 = load_config(
        "examples/repeat_grpo.yaml", [*base, "vllm.tensor_parallel_size=2", "cluster.placement=disaggregated"]
    )
    assert worker_resources(tp2)["GPU"] == 2.0
    assert required_resources(tp2)["GPU"] == 5  # 2 workers x 2 + the learner
    colocated = load_config("examples/repeat_grpo.yaml", [*base, "vllm.tensor_parallel_size=2"])
    assert required_resources(colocated)["GPU"] == 4 and shared_gpus(colocated) == 0
    assert shared_gpus(load_config("examples/repeat_grpo.yaml", base)) == 2
    cmd = launch_command("sglang", "m", "127.0.0.1", 1, tensor_parallel_size=2, base_gpu_id=2)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "2" and cmd[cmd.index("--tp-size") + 1] == "2"


def test_a_tensor_parallel_vllm_reload_sends_weights_its_worker_processes_can_unpickle():
    """With vllm.tensor_parallel_size > 1 vLLM pickles collective_rpc's arguments to its worker
    processes; a generator does not pickle ("cannot pickle 'generator' object"), so every push
    failed. The call carries a list of host tensors then."""
    import pickle

    from slime.engines.vllm import VllmEngine

    class RecordingCore:
        def __init__(self):
            self.calls = []

        def collective_rpc(self, method, kwargs=None):
            self.calls.append(pickle.loads(pickle.dumps((method, kwargs or {}))))

    engine = object.__new__(VllmEngine)  # the engine core stands in for vLLM's multiprocess executor
    engine._lora, engine._tensor_parallel_size, engine._prefix_caching = None, 2, False
    engine._engine = RecordingCore()
    weight = torch.arange(6.0).reshape(2, 3)
    engine.update_weights(3, [("model.embed_tokens.weight", weight)])
    method, kwargs = engine._engine.calls[0]
    assert method == "reload_weights"
    names = [(n, t.tolist()) for n, t in kwargs["weights_iterator"]]
    assert names == [("model.embed_tokens.weight", weight.tolist())] and engine.version == 3


def test_colocated_cuda_engines_beside_a_cpu_learner_of_more_ranks_leave_each_rank_a_bundle():
    """Colocated, engines on CUDA and the learner on CPU: the learner's placement group had a bundle
    per engine only, and rank i >= rollout.num_workers was placed in bundle i, which Ray refuses
    ("placement group bundle index 1 is invalid")."""
    from slime.config import load_config
    from slime.learner.group import _bundles, learner_resources

    overrides = ["learner.device=cpu", "rollout.device=cuda", "cluster.placement=colocated"]
    cfg = load_config(
        "examples/repeat_grpo.yaml",
        [*overrides, "learner.num_ranks=3", "rollout.num_workers=1", "learner.cpus_per_rank=1"],
    )
    per_rank = {k: v / 3 for k, v in learner_resources(cfg).items()}
    bundles = _bundles(cfg, per_rank)
    assert len(bundles) == 3 and all(b.get("CPU") == 1 for b in bundles)
    assert [b.get("GPU", 0) for b in bundles] == [1.0, 0, 0]
    assert all(b and all(v > 0 for v in b.values()) for b in bundles)  # Ray refuses an empty bundle


@pytest.mark.slow
def test_colocated_cuda_engines_beside_a_cpu_learner_of_more_ranks_start(placements):
    """The same on Ray, the ranks reserving nothing: they run outside the group, the engine on its GPU."""
    got = placements[("cpu", 2, 1)]
    assert [ids for ids, _ in got["workers"]] == [["0"]] and len(got["ranks"]) == 2, got


@pytest.mark.slow
def test_the_gpu_check_script_passes_on_cpu_with_its_mixed_precision_job(tiny_model_dir):
    """deploy/gpu_check.py is what a lent GPU runs first, once: its CPU path must pass here. Its job
    (bf16 mixed precision, probe and checksums after every push) failed its own probe check once the
    probe grew to 64 tokens (6.95e-2 against a 5e-2 floor)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "deploy/gpu_check.py", "--device", "cpu", "--tiny", "--syncs", "1", "--new-tokens", "16"]
    cmd += ["--job-steps", "2"]
    done = subprocess.run(
        [*cmd, "--job-model", str(tiny_model_dir)], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"probe and checksum checks after each push +OK", done.stdout), done.stdout[-3000:]
