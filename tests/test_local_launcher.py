"""cluster.launcher=local: the learner and rollout workers on threads of the driver's process.

The parts: a local actor's calls (one thread, in order, failures per call), the launcher's get and
wait, what the config refuses, the in-process weight transport. Then whole jobs: one that needs no
Ray at all, a multi-turn env job, and one where a breakpoint in the reward function lands in the
driver's process and SIGUSR1 prints every thread's stack. (The other end-to-end jobs run under
both launchers in their own files: sync and async in test_train_e2e.py, APRIL and a killed job in
test_april.py, streaming in test_streaming.py.)"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from slime.config import ConfigError, load_config
from slime.launch.local import LocalActorDead, LocalLauncher
from slime.weights import make_transport
from tests.helpers import TINY_JOB, wait_for

ROOT = Path(__file__).resolve().parents[1]


class _Counter:
    def __init__(self, start: int) -> None:
        self.value = start
        self.threads: list[str] = [threading.current_thread().name]

    def add(self, n: int) -> int:
        self.threads.append(threading.current_thread().name)
        time.sleep(0.01)  # a call that interleaved with another would lose an update
        self.value += n
        return self.value

    def fail(self) -> None:
        raise KeyError("no such thing")

    def wait(self, event: threading.Event) -> bool:
        return event.wait(10)


class _Broken:
    def __init__(self) -> None:
        raise OSError("no device")


def test_a_local_actor_runs_its_constructor_and_calls_on_one_thread_in_order():
    launcher = LocalLauncher()
    actor = launcher.actor(_Counter, 10, name="counter")
    refs = [actor.add.remote(1) for _ in range(20)]
    assert launcher.get(refs) == list(range(11, 31))
    assert launcher.get(actor.add.remote(0)) == 30
    instance = actor._instance
    assert set(instance.threads) == {"counter"}  # constructor and every call: the actor's own thread


def test_a_failed_call_fails_its_future_only_and_a_failed_constructor_every_call():
    launcher = LocalLauncher()
    actor = launcher.actor(_Counter, 0, name="c")
    bad = actor.fail.remote()
    good = actor.add.remote(2)
    with pytest.raises(KeyError, match="no such thing"):
        launcher.get(bad)
    assert launcher.get(good) == 2
    broken = launcher.actor(_Broken, name="broken")
    with pytest.raises(LocalActorDead, match="constructor raised OSError: no device"):
        launcher.get(broken.anything.remote(), timeout=5)


def test_wait_and_get_time_out_and_kill_fails_what_is_queued():
    launcher = LocalLauncher()
    actor = launcher.actor(_Counter, 0, name="blocked")
    event = threading.Event()
    blocking = actor.wait.remote(event)
    queued = actor.add.remote(1)
    ready, pending = launcher.wait([blocking, queued], num_returns=2, timeout=0.1)
    assert ready == [] and pending == [blocking, queued]
    with pytest.raises(launcher.timeout_error):
        launcher.get(queued, timeout=0.05)
    launcher.kill(actor)
    with pytest.raises(LocalActorDead, match="killed"):
        launcher.get(queued, timeout=5)
    with pytest.raises(LocalActorDead):
        launcher.get(actor.add.remote(1), timeout=5)
    event.set()
    assert launcher.get(blocking, timeout=5) is True  # the call it was in when killed still ends


def test_a_future_argument_is_resolved_as_a_ray_ref_would_be():
    launcher = LocalLauncher()
    a, b = launcher.actor(_Counter, 5, name="a"), launcher.actor(_Counter, 0, name="b")
    assert launcher.get(b.add.remote(a.add.remote(1)), timeout=5) == 6
    first, _ = launcher.wait([b.add.remote(0), a.wait.remote(threading.Event())], num_returns=1, timeout=5)
    assert len(first) == 1 and isinstance(first[0], concurrent.futures.Future)


@pytest.mark.parametrize(
    "setting, named",
    [
        ("learner.num_ranks=2", "learner.num_ranks=2 does not work with cluster.launcher=local"),
        ("cluster.ray_address=auto", "cluster.ray_address=auto does not work"),
        ("reward.mode=ray_actor", "reward.mode=ray_actor does not work"),
        ("weights.transport=broadcast", "weights.transport=broadcast does not work"),
        ("weights.transport=cuda_ipc", "weights.transport=cuda_ipc does not work"),
    ],
)
def test_what_cannot_run_in_one_process_is_refused_at_load_naming_the_setting(setting, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["cluster.launcher=local", setting])


def test_the_transport_follows_the_launcher_and_inproc_needs_the_local_one():
    assert load_config(None, ["cluster.launcher=local"]).weight_transport == "inproc"
    assert load_config(None, ["cluster.launcher=local", "weights.transport=shm"]).weight_transport == "shm"
    assert load_config(None, []).weight_transport == "shm"
    with pytest.raises(ConfigError, match="weights.transport=inproc needs cluster.launcher=local"):
        load_config(None, ["weights.transport=inproc"])
    with pytest.raises(ConfigError, match="rollout.elastic does not work with weights.transport=inproc"):
        load_config(None, ["cluster.launcher=local", "mode=async", "rollout.elastic.enabled=true"])


def test_the_in_process_transport_hands_the_learners_tensors_without_a_copy():
    sender = make_transport("inproc", prefix="x", directory=Path("."), bucket_mb=1)
    receiver = make_transport("inproc", prefix="x", directory=Path("."), bucket_mb=1)
    weights = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    handle = sender.publish(7, weights.items())
    assert handle.version == 7 and handle.total_bytes == 3 * 4 * 4 + 5 * 8
    got = dict(receiver.receive(handle))
    assert got.keys() == weights.keys()
    assert all(got[k].data_ptr() == weights[k].data_ptr() for k in weights)  # the same memory
    with pytest.raises(ValueError, match="an inproc receiver got a shm handle"):
        list(receiver.receive(type(handle)(1, "shm", [], [])))


# ---- whole jobs --------------------------------------------------------------------------------


def _job(tmp_path: Path, tiny_model_dir: Path, *extra: str) -> list[str]:
    return [
        "cluster.launcher=local",
        f"output_dir={tmp_path / 'run'}",
        f"model.path={tiny_model_dir}",
        *TINY_JOB,
        *extra,
    ]


@pytest.mark.slow
def test_a_local_job_trains_without_importing_ray(tiny_model_dir, tmp_path):
    """What an air-gapped GPU box needs: the job's whole path runs with Ray never imported."""
    script = (
        "import sys\n"
        "from slime.cli import main\n"
        "code = main(['train', *sys.argv[1:]])\n"
        "print('ray imported:', 'ray' in sys.modules, flush=True)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *_job(tmp_path, tiny_model_dir, "job_name=local-no-ray", "steps=2")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray imported: False" in proc.stdout
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 1]
    assert history[-1]["policy_version"] == 2 and all(h["samples"] == 4 for h in history)
    # The learner's model FLOPs each step; no MFU on a CPU (no known peak).
    assert all(h["learner_model_tflops"] > 0 and "learner_mfu" not in h for h in history)


@pytest.mark.slow
def test_a_multi_turn_env_job_runs_under_the_local_launcher(tiny_model_dir, tmp_path):
    from slime.train import train

    history = train(
        load_config(
            ROOT / "examples" / "calculator_tools.yaml",
            [
                "cluster.launcher=local",
                "job_name=local-env",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"data.path={ROOT / 'examples' / 'data' / 'calculator.jsonl'}",
                "steps=2",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=64",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1]
    assert all(h["samples"] == 4 and h["trained_tokens"] > 0 for h in history)


@pytest.mark.slow
def test_a_breakpoint_in_the_reward_stops_in_the_driver_and_sigusr1_dumps_every_thread(tiny_model_dir, tmp_path):
    """A reward function's breakpoint() reaches the driver's own breakpoint hook (pdb would stop
    there: under Ray it runs in a worker process); SIGUSR1 prints each thread's stack, the
    rollout worker's among them, and the job goes on; SIGTERM then ends it with a checkpoint."""
    (tmp_path / "hook.py").write_text(
        "import os, threading\n"
        "def stop_here(*args, **kwargs):\n"
        f"    with open({str(tmp_path / 'stopped')!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()} {threading.current_thread().name}\\n')\n"
    )
    reward = tmp_path / "debugged_reward.py"
    reward.write_text(
        "def reward(prompt, response, label, metadata):\n    breakpoint()\n    return float(len(response) % 3 == 0)\n"
    )
    env = {**os.environ, "PYTHONBREAKPOINT": "hook.stop_here", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slime.cli",
            "train",
            *_job(tmp_path, tiny_model_dir, "job_name=local-debug", "steps=200", f"reward.fn={reward}:reward"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 180, "a first step")
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None  # the dump does not stop the job
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = stderr.decode()
    assert proc.returncode == 0, text[-3000:]
    stops = (tmp_path / "stopped").read_text().split()
    assert stops and {int(pid) for pid in stops[::2]} == {proc.pid}  # every call, in the driver's process
    assert "Current thread" in text or "Thread 0x" in text
    assert "slime/rollout/worker.py" in text and "slime/train.py" in text  # the worker's thread and the loop
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


_SIGUSR1_UNDER_THREADS = """
import os, signal, sys, threading, time
from slime.errors import dump_stacks_on_sigusr1
dump_stacks_on_sigusr1()
stop = threading.Event()
def deep(depth=0):
    return deep(depth + 1) if depth < 30 else depth
def churn():  # frames pushed and popped, threads started and ended, while the dumps walk them
    while not stop.is_set():
        deep()
        threading.Thread(target=lambda: None).start()
for _ in range(4):
    threading.Thread(target=churn, daemon=True).start()
for _ in range(2000):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.001)
stop.set()
print("alive")
"""


def test_sigusr1_dumps_never_crash_a_process_whose_threads_are_running():
    # faulthandler's C-level handler walked other threads' frames while they changed and crashed a
    # job under CI load (exit -11); the main thread's Python handler holds the GIL while it dumps.
    done = subprocess.run(
        [sys.executable, "-c", _SIGUSR1_UNDER_THREADS],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and done.stdout.decode().strip() == "alive", done.stderr.decode()[-2000:]
    assert done.stderr.decode().count("Current thread") >= 1000  # the dumps were made, not dropped


def test_models_loaded_on_two_threads_at_once_keep_their_tied_head(tmp_path):
    """transformers swaps class-wide state while it loads (PreTrainedModel.tie_weights made a no-op,
    torch's init functions); the local launcher's learner and rollout worker load on two threads at
    once, and overlapping swaps left tie_weights a no-op for good and a tied head on the meta device
    (GPT-2, Gemma 3, Falcon crashed at start). slime.model loads one at a time per process."""
    from transformers import PreTrainedModel

    from benchmarks.families import tiny_model
    from slime.model import load_model

    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    tie_weights = PreTrainedModel.tie_weights
    for _ in range(4):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            models = list(pool.map(lambda _: load_model(tmp_path / "tied"), range(2)))
        for model in models:
            head = model.get_output_embeddings().weight
            assert head.device.type == "cpu" and head is model.get_input_embeddings().weight
    assert PreTrainedModel.tie_weights is tie_weights
