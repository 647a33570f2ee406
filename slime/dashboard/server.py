"""Serving the dashboard: standalone (`slime dashboard`), beside a job (that command as a child
process), or on a thread (tests).

Secrets reach the child process in its environment, never on its command line (`ps` shows that to
every user): the token in `SLIME_API_TOKEN` (security.API_TOKEN_ENV), the Redis password in
`SLIME_REDIS_PASSWORD`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

import uvicorn

from slime.dashboard.app import create_app
from slime.errors import UserError
from slime.security import API_TOKEN_ENV, write_private
from slime.security import check_bind as check_bind_any

if TYPE_CHECKING:
    from slime.config import JobConfig
    from slime.security import JobCredentials

REDIS_PASSWORD_ENV = "SLIME_REDIS_PASSWORD"


class DashboardConfigError(UserError, ValueError):
    hint = "docs/dashboard.md says which settings the dashboard takes"


def check_bind(host: str, token: str | None) -> None:
    """Anything but loopback is reachable by others: it needs a token."""
    try:
        check_bind_any(host, token, "dashboard")
    except ValueError as exc:
        raise DashboardConfigError(str(exc)) from None


class DashboardServer:
    """uvicorn on its own thread; `url` is known once the socket is bound (port 0 picks a free one)."""

    def __init__(
        self,
        redis_url: str,
        job: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        redis_password: str | None = None,
        read_only: str | None = None,
    ):
        check_bind(host, token)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            # Listening from here on: a client that reads the printed URL and connects before
            # uvicorn's loop runs waits in the backlog instead of being refused.
            self.socket.listen(128)
        except OSError as exc:
            self.socket.close()
            raise DashboardConfigError(f"dashboard cannot listen on {host}:{port}: {exc}") from None
        self.port = self.socket.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        app = create_app(redis_url, job, token, redis_password=redis_password, bind_host=host, read_only=read_only)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    def start(self) -> DashboardServer:
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="slime-dashboard", daemon=True
        )
        self.thread.start()
        return self

    def run(self) -> None:
        """Serve on this thread until Ctrl-C (the standalone `slime dashboard` process)."""
        import gc

        # Everything imported so far lives for the whole process: out of the collector's way, so a
        # full collection does not walk FastAPI's and pydantic's objects in the middle of a request.
        gc.freeze()
        self.server.run(sockets=[self.socket])

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.socket.close()


def split_password(redis_url: str) -> tuple[str, str | None]:
    """``redis://user:pw@host/0`` -> (``redis://user@host/0``, ``pw``): a URL goes on a command
    line, a password does not."""
    parts = urlsplit(redis_url)
    if parts.password is None:
        return redis_url, None
    netloc = parts.netloc.rsplit("@", 1)[1]
    if parts.username:
        netloc = f"{parts.netloc.split(':', 1)[0]}@{netloc}"
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


class DashboardProcess:
    """`slime dashboard` as a child of the job's driver. A process, not a thread: serving requests
    then never holds the driver's GIL (which delayed its refills and step boundaries, ~20% rollout
    throughput under ten polling pages), and it runs at a lower CPU priority than training."""

    def __init__(
        self,
        redis_url: str,
        job: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        redis_password: str | None = None,
    ):
        check_bind(host, token)
        redis_url, url_password = split_password(redis_url)
        redis_password = redis_password or url_password
        if port == 0:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "slime.cli",
            "dashboard",
            "--redis",
            redis_url,
            "--job",
            job,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if shutil.which("nice"):
            cmd = ["nice", "-n", "10", *cmd]
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        for name, value in ((API_TOKEN_ENV, token), (REDIS_PASSWORD_ENV, redis_password)):
            env.pop(name, None)  # never one inherited from whoever started the job
            if value:
                env[name] = value
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.proc.stdout.readline()  # the URL line, printed once the socket is bound
        if "http://" not in first:
            rest = self.proc.stdout.read()
            self.proc.wait()
            raise DashboardConfigError(f"the dashboard did not start: {(first + rest).strip()}")
        self.url = first.split(": ", 1)[1].split("?")[0].split()[0].strip()
        threading.Thread(target=self._drain, name="slime-dashboard-log", daemon=True).start()

    @classmethod
    def for_job(cls, cfg: JobConfig, redis_url: str, credentials: JobCredentials, run_dir: Path) -> DashboardProcess:
        """A job's dashboard (dashboard.enabled); its control token in run_dir/dashboard.token (0600)."""
        d = cfg.dashboard
        token = d.token or credentials.token("dashboard")
        token_file = write_private(run_dir / "dashboard.token", token + "\n")
        port = d.port
        if "port" not in d.model_fields_set and port and not _port_free(d.host, port):
            print(f"dashboard: port {port} is taken (another job's dashboard?); this one takes a free port", flush=True)
            port = 0  # the default port only: a port set on purpose that is taken stays an error
        dashboard = cls(redis_url, cfg.job_name, d.host, port, token, redis_password=credentials.redis_password)
        print(f"dashboard: {dashboard.url} (control token in {token_file})", flush=True)
        return dashboard

    def _drain(self) -> None:
        for line in self.proc.stdout:  # its warnings and errors reach the job's console
            print(f"[dashboard] {line}", end="", flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
