"""`slime submit`, `slime status`, `slime logs`, `slime stop`: jobs on a Ray cluster through Ray's Jobs API.

`slime submit CFG.yaml --address http://HEAD:8265 key=value ...` uploads this project directory (the
job's working directory, without virtual environments, git history, outputs and caches) and runs
`python -m slime.cli train CFG.yaml cluster.ray_address=auto key=value ...` on the head node: the
job joins the cluster it runs on instead of starting a Ray of its own. The cluster's `python` must
have slime's dependencies installed (deploy/local_cluster.py puts its own interpreter first on PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from ray.job_submission import JobDetails, JobSubmissionClient

from slime.config import ConfigError, JobConfig, load_config

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # slime/tools/submit.py -> the checkout
# Left out of the upload (Ray refuses a working directory over 512 MiB zipped; these are GiBs).
UPLOAD_EXCLUDES = [
    ".git",
    ".venv*",
    "outputs",
    "runs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".cache",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    ".import_linter_cache",
]
# Handed to the job when set here: how it talks to Ray and how many threads torch and BLAS take.
FORWARDED_ENV = ("RAY_AUTH_MODE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_JOB_STOP_WAIT_TIME_S")
# `slime stop` sends SIGTERM, then SIGKILL after this long (Ray's default: 3 s). The job needs the time
# to finish its step, write a checkpoint and stop its redis-server; a SIGKILL leaves that server behind.
STOP_WAIT_S = "300"
AGENT_WAIT_S = 60.0  # how long submit waits for a just-started cluster's job agent
ADDRESS_HELP = "the cluster's Jobs API: http://HEAD:8265 (its dashboard) or ray://HEAD:10001 (default: $RAY_ADDRESS)"


class JobsApiError(Exception):
    """A cluster the Jobs API cannot reach or a request it refused: one line for the user."""


def connect(address: str | None) -> JobSubmissionClient:
    """A client of the Jobs API at `address` (else $RAY_ADDRESS); HOST:PORT means the dashboard."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise JobsApiError("no cluster address: pass --address http://HEAD:8265 (the dashboard) or set RAY_ADDRESS")
    if "://" not in address:
        address = f"http://{address}"
    scheme = address.partition("://")[0]
    if scheme not in ("http", "https", "ray"):
        raise JobsApiError(f"address {address}: expected http://HOST:PORT (the dashboard) or ray://HOST:PORT")
    # The SDK takes these in preference to its argument; --address must win.
    saved = {name: os.environ.pop(name) for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if name in os.environ}
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # the SDK raises ConnectionError, RuntimeError, ValueError... by how it failed
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobsApiError(
            f"cannot reach the Ray Jobs API at {address}: {first_line} (--address takes the dashboard's URL, "
            "e.g. http://HEAD:8265, not the GCS address)"
        ) from None
    finally:
        os.environ.update(saved)


def config_in_project(config_path: str) -> str:
    """The config's path inside the uploaded working directory. A config outside the project, or in a
    folder the upload leaves out, is refused: the job could not read it."""
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        # A non-editable install (pip install ., the images): the package sits in site-packages.
        raise ConfigError(
            f"slime submit uploads the project's source folder, and this slime is installed at {PROJECT_ROOT} "
            "(no pyproject.toml there): run it from a checkout installed with pip install -e ."
        )
    path = Path(config_path).expanduser().resolve()
    try:
        relative = path.relative_to(PROJECT_ROOT)
    except ValueError:
        raise ConfigError(
            f"{config_path}: outside the project directory {PROJECT_ROOT}, which is what the job uploads; "
            "copy the config into it (e.g. examples/)"
        ) from None
    excluded = [p for p in UPLOAD_EXCLUDES if any(fnmatch.fnmatch(part, p) for part in relative.parts)]
    if excluded:
        raise ConfigError(f"{config_path}: in {excluded[0]}, which the upload leaves out; move it (e.g. to examples/)")
    return relative.as_posix()


def check_submittable(cfg: JobConfig) -> None:
    if cfg.cluster.num_cpus is not None:
        raise ConfigError(
            "cluster.num_cpus sizes a Ray the job starts itself; a submitted job joins the cluster's Ray: remove it"
        )


def entrypoint(config: str | None, overrides: list[str]) -> str:
    """The job's command; the user's own cluster.ray_address, if any, comes later and wins."""
    return shlex.join(
        ["python", "-m", "slime.cli", "train", *([config] if config else []), "cluster.ray_address=auto", *overrides]
    )


def submit(ns: argparse.Namespace) -> int:
    config, overrides = (ns.args[0], ns.args[1:]) if ns.args and "=" not in ns.args[0] else (None, ns.args)
    cfg = load_config(config, overrides)
    check_submittable(cfg)
    relative_config = config_in_project(config) if config else None
    client = connect(ns.address)
    runtime_env = {
        "working_dir": str(PROJECT_ROOT),
        "excludes": UPLOAD_EXCLUDES,
        "env_vars": {
            "RAY_JOB_STOP_WAIT_TIME_S": STOP_WAIT_S,
            **{name: os.environ[name] for name in FORWARDED_ENV if name in os.environ},
        },
    }
    # A cluster just started answers "No available agent" until a node's job agent is up: wait.
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            submission_id = client.submit_job(
                entrypoint=entrypoint(relative_config, overrides),
                runtime_env=runtime_env,
                metadata={"slime_job_name": cfg.job_name},
            )
            break
        except (RuntimeError, ValueError, OSError) as exc:  # e.g. an upload over Ray's size limit
            if "No available agent" in str(exc) and time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            raise JobsApiError(f"the cluster at {client.get_address()} refused the job: {exc}") from None
    address = client.get_address()
    print(f"submitted {submission_id} (job {cfg.job_name!r}) to {address}")
    if not Path(cfg.output_dir).expanduser().is_absolute():
        print(
            f"note: output_dir {cfg.output_dir!r} is relative: it lands in the job's unpacked working directory "
            "on the head node; set an absolute path on shared storage to keep checkpoints and metrics"
        )
    print(f"  follow: slime logs {submission_id} --address {address} --follow")
    print(f"  status: slime status {submission_id} --address {address}")
    print(f"  stop:   slime stop {submission_id} --address {address}")
    return 0


def _started(job: JobDetails) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000)) if job.start_time else "-"


def status(ns: argparse.Namespace) -> int:
    client = connect(ns.address)
    if ns.id is not None:
        job = client.get_job_info(ns.id)
        print(f"{ns.id}: {job.status.value}" + (f" ({job.message})" if job.message else ""))
        return 1 if job.status.value == "FAILED" else 0  # a script following the job sees how it ended
    jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    rows = [("ID", "STATUS", "STARTED", "JOB")] + [
        (
            j.submission_id or f"{j.job_id} (driver)",
            j.status.value,
            _started(j),
            (j.metadata or {}).get("slime_job_name", "-"),
        )
        for j in jobs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


async def _follow(client: JobSubmissionClient, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


def logs(ns: argparse.Namespace) -> int:
    client = connect(ns.address)
    if ns.follow:
        client.get_job_info(ns.id)  # an unknown id: the Jobs API's one-line answer, not a websocket error
        try:
            asyncio.run(_follow(client, ns.id))
        except KeyboardInterrupt:  # stops following; the job runs on
            return 130
        job = client.get_job_info(ns.id)
        print(f"{ns.id}: {job.status.value}" + (f" ({job.message})" if job.message else ""))
        return 0
    print(client.get_job_logs(ns.id), end="")
    return 0


def stop(ns: argparse.Namespace) -> int:
    client = connect(ns.address)
    if client.stop_job(ns.id):
        print(
            f"{ns.id}: stop requested: SIGTERM, the job finishes its step and writes a checkpoint; "
            f"`slime status {ns.id}` says STOPPED once it ended"
        )
    else:
        print(f"{ns.id}: not running ({client.get_job_info(ns.id).status.value})")
    return 0


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"slime {command}")
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    if command == "submit":
        parser.description = "Run `slime train` as a Ray job on a cluster (this project directory is uploaded)."
        parser.add_argument("args", nargs="*", help="[CONFIG.yaml] then key.path=value overrides")
    elif command == "status":
        parser.description = "One job's status and message, or a table of the cluster's jobs."
        parser.add_argument("id", nargs="?", default=None, help="submission id (raysubmit_...)")
    else:
        parser.add_argument("id", help="submission id (raysubmit_...)")
    if command == "logs":
        parser.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
    return parser


def main_jobs(argv: list[str]) -> int:
    """argv[0] is one of submit, status, logs, stop."""
    command = argv[0]
    ns = _parser(command).parse_intermixed_args(argv[1:])
    logging.getLogger("ray").setLevel(logging.ERROR)  # the SDK narrates every file it packs at INFO/WARNING
    run = {"submit": submit, "status": status, "logs": logs, "stop": stop}[command]
    try:
        return run(ns)
    except (ConfigError, JobsApiError) as exc:
        print(f"slime {command}: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:  # the Jobs API's answer to a bad request (an unknown id), a lost link
        print(f"slime {command}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
