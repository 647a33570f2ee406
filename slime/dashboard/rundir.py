"""`slime dashboard RUN_DIR`: a run's buffer found from its run directory (docs/dashboard.md).

- A job on its own `redis-server` (no `buffer.url`): while the job runs, that server answers on
  the port in `RUN_DIR/redis/redis.conf` with the password derived from `RUN_DIR/job.secret`, and
  the dashboard attaches to it. Once the run has finished, the AOF is copied to a temporary
  directory and a `redis-server` of our own replays the copy: the run directory is only read.
- A job on an external Redis or Redis Cluster (`buffer.url` in `RUN_DIR/config.yaml`): its data
  stays there, running or finished; the dashboard attaches to it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from slime.buffer.connection import open_client
from slime.buffer.redis_server import CONFIG_FILE_NAME, LocalRedisServer
from slime.dashboard.server import REDIS_PASSWORD_ENV, DashboardConfigError, split_password
from slime.security import REDACTED, SECRET_FILE_NAME, JobCredentials, redact_url

# What a redis-server keeps of a buffer: Redis 7's AOF directory, Redis 6's single AOF, a snapshot.
DATA_ENTRIES = ("appendonlydir", "appendonly.aof", "dump.rdb")
READ_ONLY_REASON = (
    "this dashboard serves a read-only copy of a finished run's buffer: control routes "
    "(pause, resume, oversample, requeue, drop) are refused"
)


class RunDirError(DashboardConfigError):
    hint = "give the output_dir of a `slime train` run (it holds config.yaml, job.secret and redis/), or use --redis URL --job NAME"


@dataclass
class RunBuffer:
    """Where a run's buffer is served from; ``close()`` stops and deletes a read-only copy."""

    run_dir: Path
    job: str
    url: str
    redis_password: str | None
    credentials: JobCredentials
    copy_dir: Path | None = None  # set: a finished run, served from this copy
    server: LocalRedisServer | None = None

    @property
    def read_only(self) -> bool:
        return self.copy_dir is not None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.copy_dir is not None:
            shutil.rmtree(self.copy_dir, ignore_errors=True)


def open_run_buffer(run_dir: str | Path) -> RunBuffer:
    """Attach to a running job's buffer, or start a server over a copy of a finished run's."""
    run_dir = Path(run_dir).expanduser().resolve()
    job, buffer_url = _read_config(run_dir)
    secret_file = run_dir / SECRET_FILE_NAME
    if not secret_file.is_file():
        raise RunDirError(f"{run_dir} has no {SECRET_FILE_NAME}: the dashboard token and Redis password derive from it")
    if buffer_url is not None:
        credentials = JobCredentials.read(run_dir, own_redis=False)
        url, password = _remote_buffer(buffer_url)
        return RunBuffer(run_dir, job, url, password, credentials)
    credentials = JobCredentials.read(run_dir, own_redis=True)
    live_url = _live_local_url(run_dir / "redis", credentials.redis_password)
    if live_url is not None:
        return RunBuffer(run_dir, job, live_url, credentials.redis_password, credentials)
    return _serve_copy(run_dir, job, credentials)


def _read_config(run_dir: Path) -> tuple[str, str | None]:
    """(job_name, buffer.url) from the run's config.yaml."""
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise RunDirError(f"{run_dir} is not a run directory: it has no config.yaml")
    try:
        config = yaml.safe_load(path.read_text()) or {}
        job = config["job_name"]
        buffer_url = (config.get("buffer") or {}).get("url")
    except (yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:
        raise RunDirError(f"{path} is not a run's config (no job_name): {exc}") from None
    return str(job), buffer_url


def _remote_buffer(buffer_url: str) -> tuple[str, str | None]:
    """(URL without its password, password) of a job's external Redis, checked to answer PING.
    config.yaml keeps the URL with its password replaced by ***: the real one comes from the
    environment."""
    url, password = split_password(buffer_url)
    if password == REDACTED:
        password = os.environ.get(REDIS_PASSWORD_ENV) or None
        if password is None:
            raise RunDirError(
                f"the run's buffer.url {buffer_url} has a password, which config.yaml does not keep",
                hint=f"set {REDIS_PASSWORD_ENV} to the Redis password",
            )
    try:
        client = open_client(url, password=password, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, RedisClusterException, ValueError) as exc:
        raise RunDirError(
            f"the run's buffer (buffer.url {redact_url(url)}) does not answer: {exc}",
            hint="a job on an external Redis keeps its trajectories there: start that Redis (or cluster) again",
        ) from None
    return url, password


def _live_local_url(redis_dir: Path, password: str | None) -> str | None:
    """The URL of the job's own redis-server when it runs and takes this run's password: the port
    alone could belong to another server by now."""
    try:
        match = re.search(r"^port (\d+)$", (redis_dir / CONFIG_FILE_NAME).read_text(), re.MULTILINE)
    except OSError:
        return None
    if match is None:
        return None
    url = f"redis://127.0.0.1:{match.group(1)}/0"
    client = redis.Redis.from_url(url, password=password, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.BusyLoadingError:
        return url  # ours, replaying its AOF after a restart
    except redis.RedisError:
        return None
    finally:
        client.close()
    return url


COPY_PREFIX = "slime-dashboard-copy-"
OWNER_FILE = "dashboard.pid"  # the pid of the dashboard serving the copy


def _remove_orphaned_copies() -> None:
    """Copies left by dashboards that were killed (SIGKILL skips every cleanup; their redis-server
    died with them, by the parent-death signal): each names its dashboard's pid."""
    for copy_dir in Path(tempfile.gettempdir()).glob(COPY_PREFIX + "*"):
        try:
            if copy_dir.stat().st_uid != os.getuid():
                continue
            owner = int((copy_dir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or a copy from before the owner file: left alone
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(copy_dir, ignore_errors=True)


def _serve_copy(run_dir: Path, job: str, credentials: JobCredentials) -> RunBuffer:
    redis_dir = run_dir / "redis"
    stored = [redis_dir / name for name in DATA_ENTRIES if (redis_dir / name).exists()]
    if not stored:
        raise RunDirError(
            f"{run_dir} holds no stored buffer: no AOF in {redis_dir}",
            hint="a run keeps its trajectories only with buffer.aof=true (the default) on its own redis-server",
        )
    _remove_orphaned_copies()
    copy_dir = Path(tempfile.mkdtemp(prefix=COPY_PREFIX))
    (copy_dir / OWNER_FILE).write_text(str(os.getpid()))
    try:
        # Only the data: the copy's server writes its own redis.conf, log and pid file, and the
        # run's server.json must not be there (LocalRedisServer stops the server a pid file names).
        for path in stored:
            if path.is_dir():
                shutil.copytree(path, copy_dir / path.name)
            else:
                shutil.copy2(path, copy_dir / path.name)
        server = LocalRedisServer(copy_dir, aof=True, password=credentials.redis_password)
    except BaseException as exc:  # Ctrl-C during a long copy too: no copy is left behind
        shutil.rmtree(copy_dir, ignore_errors=True)
        if not isinstance(exc, (OSError, RuntimeError)):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunDirError(f"cannot serve a copy of {redis_dir}: {first}") from None
    return RunBuffer(run_dir, job, server.url, credentials.redis_password, credentials, copy_dir, server)
