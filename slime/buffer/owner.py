"""One live run per job name on a Redis. A fresh run deletes every key of its job, so a second run
that shares a Redis (buffer.url) and, by mistake, the job name would wipe the first run's buffer,
then both would train on one mixed buffer. The run holds the job's owner key (`owner`: its
output_dir, host and pid) with a short TTL that a thread renews; a run of another output_dir finds
it held and stops before it touches anything (TrajectoryStore.delete_job leaves the key alone). A
restart of the same run (the same output_dir, e.g. resume=auto after kill -9, on this host or a
new pod) takes it over at once."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from slime.buffer.connection import JobConnection
from slime.errors import UserError

log = logging.getLogger(__name__)

OWNER_TTL_S = 60.0  # a run that died holds its job name this long (a restart of the same run: not at all)
RENEW_EVERY_S = 10.0


class JobNameInUseError(UserError, RuntimeError):
    hint = "give this run another job_name, or stop the other run (resume=auto continues a run in its own output_dir)"


class JobOwner:
    def __init__(self, connection: JobConnection, run_dir: Path, job: str) -> None:
        self.connection = connection
        same = {"output_dir": str(Path(run_dir).resolve())}
        self._same = json.dumps(same)[:-1] + ","  # the json of `me` up to its host and pid
        self._me = json.dumps({**same, "host": socket.gethostname(), "pid": os.getpid()})
        self._script = connection.script("owner.lua")
        taken, holder, ttl_ms = self._call("claim")
        if not taken:
            other = json.loads(holder)
            raise JobNameInUseError(
                f"job_name {job!r} is in use on this Redis by a live run (host {other.get('host')}, output_dir "
                f"{other.get('output_dir')}, pid {other.get('pid')}; it renews its claim every {RENEW_EVERY_S:g} s, "
                f"held {max(0, int(ttl_ms)) / 1000:.0f} s more): a fresh run would delete that run's buffer"
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="slime-job-owner", daemon=True)
        self._thread.start()

    def _call(self, action: str) -> tuple[int, str, int]:
        ok, holder, ttl = self._script([self.connection.prefix, action, self._me, int(OWNER_TTL_S * 1000), self._same])
        return int(ok), holder.decode() if isinstance(holder, bytes) else str(holder), int(ttl)

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                held = self._call("renew")[0]  # takes the key back if the server lost it
            except Exception:  # noqa: BLE001 - a restart, a failover (cluster errors are not RedisErrors): retry
                continue
            if not held and not warned:
                warned = True
                log.warning("another run took this job name (this one renewed too late: was it stopped?)")
            if held:
                warned = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=RENEW_EVERY_S + 5)
        started = time.monotonic()
        while time.monotonic() - started < 5:
            try:
                self._call("release")
                return
            except Exception:  # noqa: BLE001 - the claim then expires by itself
                time.sleep(0.5)
