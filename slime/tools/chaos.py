"""`slime chaos [CONFIG.yaml] [key=value ...] --seed S --faults worker_kill,worker_hang,learner_kill,redis_kill`:
run a short real job (`slime train` in a child process) and hurt it on a seeded schedule, then
audit what it left behind.

Faults, each on one process of the job (a Ray actor found by its name, or the job's redis-server):
    worker_kill   SIGKILL of a rollout worker actor
    worker_hang   SIGSTOP of a rollout worker actor (it answers nothing; rollout.hang_timeout_s)
    learner_kill  SIGKILL of the learner actor
    redis_kill    SIGKILL of the job's redis-server
    reward_kill   SIGKILL of the reward actor (reward.mode=ray_actor)
    reward_hang   SIGSTOP of the reward actor (reward.mode=ray_actor; reward.request_timeout_s)

The job recovers by itself: train() restarts from its last checkpoint and the buffer after a lost
rollout worker or learner; the driver restarts its redis-server on the same port (AOF replayed)
while every part retries; Ray restarts a dead reward actor, and the workers kill a hung one to be
restarted, retrying their batches. Per fault: the time from the fault to the first output after
the recovery (a token generated; for a reward fault, a sample scored) and to the first step
trained after it (for a reward fault: after that first scored sample). Then the audit, from the job's Redis (its AOF) and its files:
    groups lost or trained twice   groups_trained == steps x batch_size (not in streaming mode), none left claimed
    prompts trained twice          no prompt trained more often than the data's epochs allow
    steps logged twice or missing  metrics.jsonl holds 0..steps-1, each once
    trajectories lost              every sample final, or partial (its tokens kept), or failed with a reason
    tokens lost                    tokens stored + tokens discarded by a restart == tokens generated
Every "lost" or "twice" figure must be 0. Not injected: kills of an HTTP reward server (`slime
reward-serve` is the user's process, not the job's; the workers retry it with backoff).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from slime.buffer import JobConnection, TrajectoryStore
from slime.buffer.redis_server import LocalRedisServer
from slime.config import ConfigError, JobConfig, load_config
from slime.sample import FINAL_STATUSES, Status
from slime.security import JobCredentials

FAULTS = {"worker_kill": ("RolloutWorker", signal.SIGKILL), "worker_hang": ("RolloutWorker", signal.SIGSTOP)}
FAULTS["learner_kill"] = ("Learner", signal.SIGKILL)
FAULTS["redis_kill"] = ("redis-server", signal.SIGKILL)
FAULTS["reward_kill"] = ("RewardActor", signal.SIGKILL)
FAULTS["reward_hang"] = ("RewardActor", signal.SIGSTOP)
RESTART_NOTICE = "restarting from the last checkpoint"
REDIS_RESTART_NOTICE = "redis-server exited"  # slime/job.py, RunningJob._redis_restarted


def recovery_notice(kind: str) -> str | None:
    """The stderr line that says the job recovered from a fault of this kind (None: the job goes
    on without a restart, and the recovery shows only as new tokens and steps)."""
    if kind.startswith("reward_"):
        return None
    return REDIS_RESTART_NOTICE if kind == "redis_kill" else RESTART_NOTICE


@dataclass
class Fault:
    kind: str
    after_steps: int  # injected once metrics.jsonl holds this many steps
    injected_at: float | None = None
    restarted_at: float | None = None
    first_output_s: float | None = None  # first token generated (a reward fault: first sample scored)
    next_step_s: float | None = None
    output_at_restart: float | None = None


@dataclass
class ChaosRun:
    cfg: JobConfig
    faults: list[Fault]
    stderr: list[str] = field(default_factory=list)


def plan(seed: int, kinds: list[str], steps: int, count: int | None = None) -> list[Fault]:
    """`count` faults (default: one of each kind), kinds in a seeded order, spread over the run's
    steps with seeded jitter; none in the last two steps, so each has a step to recover into."""
    count = len(kinds) if count is None else count
    if count < 1 or steps < 2 * count + 2:
        raise ValueError(f"{count} faults need steps >= {2 * count + 2} (got steps={steps})")
    rng = random.Random(seed)
    order = [k for _ in range(-(-count // len(kinds))) for k in rng.sample(kinds, len(kinds))][:count]
    gap = (steps - 2) // count
    return [Fault(kind, 1 + i * gap + rng.randrange(max(1, gap - 1))) for i, kind in enumerate(order)]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def actor_pid(root: int, actor: str) -> int | None:
    """The process of the job (under `root`) that runs the Ray actor class `actor`."""
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(f"ray::{actor}".encode()):
                    return pid
        except OSError:
            continue
    return None


def _metric_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # being written
    return rows


def _output(run: Path, job: str, kind: str) -> float | None:
    """The live job's generated-token counter (a reward fault: its count of scored samples), or
    None while its Redis is down (a restart)."""
    try:
        port = json.loads((run / "redis" / "server.json").read_text())["port"]
        connection = JobConnection(
            f"redis://127.0.0.1:{port}/0", job, password=JobCredentials.read(run).redis_password, reconnect_timeout_s=1
        )
        store = TrajectoryStore(connection)
        try:
            if kind.startswith("reward_"):
                counts = store.counts()
                return float(sum(counts[s.value] for s in FINAL_STATUSES))
            return float(store.stats().get("generated_tokens", 0.0))
        finally:
            store.connection.close()
    except Exception:
        return None


def run(
    cfg_path: str | None,
    overrides: list[str],
    seed: int,
    kinds: list[str],
    count: int | None = None,
    timeout_s: float = 1200,
) -> dict:
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {sorted(FAULTS)}")
    settings = [*overrides, f"max_restarts={(count or len(kinds)) + 1}"]
    if not any(o.startswith("rollout.hang_timeout_s=") for o in overrides):
        settings.append("rollout.hang_timeout_s=5")
    if not any(o.startswith("reward.request_timeout_s=") for o in overrides):
        settings.append("reward.request_timeout_s=5")
    cfg = load_config(cfg_path, settings)
    reward_faults = sorted(k for k in kinds if k.startswith("reward_"))
    if reward_faults and cfg.reward.mode != "ray_actor":
        if any(o.startswith("reward.mode=") for o in overrides):
            raise ConfigError(
                f"{', '.join(reward_faults)} hurt the reward actor: they need reward.mode=ray_actor "
                f"(got reward.mode={cfg.reward.mode}; or leave them out of --faults)"
            )
        settings.append("reward.mode=ray_actor")
        cfg = load_config(cfg_path, settings)
        print(f"slime chaos: {', '.join(reward_faults)} hurt the reward actor: running with reward.mode=ray_actor")
    if cfg.resume is not None or cfg.buffer.url is not None:
        raise ValueError("chaos runs a fresh job with its own Redis: leave resume and buffer.url unset")
    faults = plan(seed, kinds, cfg.steps, count)
    argv = [sys.executable, "-m", "slime.cli", "train", *([cfg_path] if cfg_path else []), *settings]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    chaos = ChaosRun(cfg, faults)
    # stderr lines as they come (the restart notices); the stream is read to its end.
    reader = threading.Thread(target=lambda: chaos.stderr.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + timeout_s
    try:
        for index, fault in enumerate(faults):  # one at a time: the next once the last recovered
            earlier = sum(recovery_notice(f.kind) == recovery_notice(fault.kind) for f in faults[:index])
            _watch(proc, chaos, fault, earlier, deadline)
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=10)
    report = audit(chaos, proc.returncode)
    report["faults"] = [
        {
            "kind": f.kind,
            "after_steps": f.after_steps,
            "injected": f.injected_at is not None,
            "recovered": f.next_step_s is not None,
            "fault_to_first_output_s": None if f.first_output_s is None else round(f.first_output_s, 1),
            "fault_to_next_step_s": None if f.next_step_s is None else round(f.next_step_s, 1),
        }
        for f in faults
    ]
    return report


def _fault_pid(root: int, run_dir: Path, kind: str) -> int | None:
    if kind == "redis_kill":
        try:
            return int(json.loads((run_dir / "redis" / "server.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return actor_pid(root, FAULTS[kind][0])


def _watch(proc: subprocess.Popen, chaos: ChaosRun, fault: Fault, earlier: int, deadline: float) -> None:
    """Inject `fault` once the job has logged its steps, then time the recovery: the job's
    recovery notice (the `earlier`+1-th of its kind), its first new token, its first step logged
    after it."""
    cfg = chaos.cfg
    metrics = cfg.run_dir / "metrics.jsonl"
    before: set[tuple] = set()

    def timed() -> bool:  # the first new token may come after the next step: wait a little for it
        return fault.next_step_s is not None and (
            fault.first_output_s is not None or time.time() - fault.injected_at > fault.next_step_s + 30
        )

    while proc.poll() is None and time.time() < deadline and not timed():
        time.sleep(0.1)
        rows = _metric_rows(metrics)
        if fault.injected_at is None:
            pid = _fault_pid(proc.pid, cfg.run_dir, fault.kind) if len(rows) >= fault.after_steps else None
            if pid is not None:
                os.kill(pid, FAULTS[fault.kind][1])
                fault.injected_at = time.time()
            continue
        if fault.restarted_at is None:
            notice = recovery_notice(fault.kind)
            if notice is None or sum(notice in line for line in chaos.stderr) > earlier:
                fault.restarted_at = time.time()
                before = {(r.get("step"), r.get("wall_seconds")) for r in rows}
            continue
        if fault.first_output_s is None:
            output = _output(cfg.run_dir, cfg.job_name, fault.kind)
            if output is not None and fault.output_at_restart is None:
                fault.output_at_restart = output
            elif output is not None and output > (fault.output_at_restart or 0.0):
                fault.first_output_s = time.time() - fault.injected_at
        if fault.first_output_s is None and recovery_notice(fault.kind) is None:
            continue  # no restart to wait for: a step counts once the job produced again
        if fault.next_step_s is None and any((r.get("step"), r.get("wall_seconds")) not in before for r in rows):
            fault.next_step_s = time.time() - fault.injected_at


def audit(chaos: ChaosRun, returncode: int | None) -> dict:
    """What the job left: every group trained once, every step logged once, no trajectory or token lost."""
    cfg = chaos.cfg
    rows = _metric_rows(cfg.run_dir / "metrics.jsonl")
    steps = [int(r["step"]) for r in rows]
    with LocalRedisServer(cfg.run_dir / "redis", password="chaos-audit") as server:
        store = TrajectoryStore.open(server.url, cfg.job_name, password="chaos-audit")
        counts, stats = store.counts(), store.stats()
        samples = list(store.iter_samples())
        trained = {gid.decode() for gid in store.redis.zrange(store.connection.key("trained"), 0, -1)}
        store.connection.close()
    expected_groups = cfg.steps * cfg.rollout.batch_size
    streaming = cfg.loop_mode == "streaming"
    unaccounted = [
        s.id
        for s in samples
        if not (
            s.status in FINAL_STATUSES - {Status.FAILED}
            or (s.status == Status.FAILED and s.failure)
            or s.status in (Status.PENDING, Status.ABORTED, Status.RUNNING)  # queued, tokens kept
        )
    ]
    # Trained trajectories the buffer pruned (buffer.keep_trained_steps) were stored, then deleted.
    stored_tokens = sum(s.response_length for s in samples) + int(stats.get("pruned_tokens", 0.0))
    generated = stats.get("generated_tokens", 0.0) - stats.get("restarted_tokens", 0.0)
    return {
        "exit_code": returncode,
        "restarts": sum(RESTART_NOTICE in line for line in chaos.stderr),
        "redis_restarts": sum(REDIS_RESTART_NOTICE in line for line in chaos.stderr),
        "steps_logged": len(steps),
        "steps_missing": len(set(range(cfg.steps)) - set(steps)),
        "steps_logged_twice": len(steps) - len(set(steps)),
        "groups_trained": counts["groups_trained"],
        # Streaming trains segments as they come, not batch_size groups a step: no such count to meet.
        "groups_lost": None if streaming else max(0, expected_groups - counts["groups_trained"]),
        "groups_trained_twice": None if streaming else max(0, counts["groups_trained"] - expected_groups),
        "groups_left_claimed": counts["groups_claimed"],
        "prompts_trained_twice": _prompts_trained_twice(samples, trained, cfg.run_dir),
        "trajectories": len(samples) + int(stats.get("pruned_samples", 0.0)),
        "trajectories_lost": len(unaccounted),
        "tokens_stored": stored_tokens,
        "tokens_lost": int(round(generated - stored_tokens)),
        "stderr_tail": "".join(chaos.stderr)[-2000:] if returncode else "",
    }


def _prompts_trained_twice(samples: list, trained: set[str], run_dir: Path) -> int:
    """Trainings of a prompt beyond what the data's epochs allow (each prompt once per epoch: at most
    ceil(prompts drawn / records) times): a resume that drew again prompts the buffer still held
    trained them twice. Groups whose trajectories were pruned are not seen."""
    latest = run_dir / "checkpoints" / "latest"
    try:
        state = json.loads((run_dir / "checkpoints" / latest.read_text().strip() / "driver_state.json").read_text())
        records = int(state["sampler"]["num_records"])
        draws = int(state["sampler"].get("draws", len(trained)))
    except (OSError, ValueError, KeyError):
        return 0
    index_of_group = {s.group_id: s.metadata.get("record_index") for s in samples if s.group_id in trained}
    times = Counter(i for i in index_of_group.values() if i is not None)
    allowed = -(-max(draws, 1) // max(1, records))
    return sum(max(0, n - allowed) for n in times.values())


def clean(report: dict) -> bool:
    lost = ("steps_missing", "steps_logged_twice", "groups_lost", "groups_trained_twice", "groups_left_claimed")
    lost += ("prompts_trained_twice",)
    return (
        report["exit_code"] == 0
        and all(report[k] in (0, None) for k in (*lost, "trajectories_lost", "tokens_lost"))
        and all(f["injected"] and f["recovered"] for f in report["faults"])
    )


def print_report(report: dict) -> None:
    print(f"{'fault':<13} {'after step':>10} {'recovered':>9} {'to first output':>16} {'to next step':>13}")
    for f in report["faults"]:
        token = "-" if f["fault_to_first_output_s"] is None else f"{f['fault_to_first_output_s']:.1f} s"
        step = "-" if f["fault_to_next_step_s"] is None else f"{f['fault_to_next_step_s']:.1f} s"
        print(f"{f['kind']:<13} {f['after_steps']:>10} {str(f['recovered']):>9} {token:>16} {step:>13}")
    keys = (
        "exit_code",
        "restarts",
        "redis_restarts",
        "steps_missing",
        "steps_logged_twice",
        "groups_lost",
        "groups_trained_twice",
    )
    keys += (
        "groups_left_claimed",
        "prompts_trained_twice",
        "trajectories",
        "trajectories_lost",
        "tokens_stored",
        "tokens_lost",
    )
    print("  ".join(f"{k}={report[k]}" for k in keys))
    print("clean" if clean(report) else "NOT CLEAN: something was lost, duplicated or did not recover")


def main_chaos(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="slime chaos", description=__doc__.splitlines()[0])
    ap.add_argument("args", nargs="*", help="[CONFIG.yaml] then key.path=value overrides (as slime train)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {', '.join(FAULTS)}")
    ap.add_argument("--count", type=int, default=None, help="faults in all (default: one of each kind)")
    ap.add_argument("--timeout-s", type=float, default=1200)
    ns = ap.parse_args(argv)
    cfg_path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if cfg_path else ns.args
    report = run(cfg_path, overrides, ns.seed, ns.faults.split(","), ns.count, ns.timeout_s)
    print_report(report)
    print(json.dumps({k: v for k, v in report.items() if k != "stderr_tail"}))
    return 0 if clean(report) else 1
