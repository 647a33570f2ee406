"""One job's keys on one Redis server: the client that the parts of the buffer share in a process,
the key prefix, the server's clock, and the Lua scripts (slime/buffer/lua/) with their reply codes."""

from __future__ import annotations

import re
from enum import IntEnum
from functools import cache
from importlib import resources

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from slime.security import redact_url

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


class ScriptReply(IntEnum):
    """Codes the per-sample scripts return as the first element of their reply."""

    OK = 0
    LEASE_LOST = -1
    BAD_CHUNK = -2
    STORED_MISMATCH = -3
    NO_SAMPLE = -4
    WRONG_STATUS = -5


@cache
def lua_source(*files: str) -> str:
    """The named files of slime/buffer/lua/, concatenated in order (helpers before the script)."""
    folder = resources.files("slime.buffer").joinpath("lua")
    return "\n".join(folder.joinpath(name).read_text() for name in files)


def _reconnect(url: str, job: str, password: str | None) -> JobConnection:
    return JobConnection(url, job, password=password)


class JobConnection:
    """The Redis client and key prefix of one job; the store, the telemetry and the dashboard's
    queries of one process share one (`TrajectoryStore(connection)`, `JobTelemetry(connection)`)."""

    def __init__(self, url: str, job: str, *, password: str | None = None) -> None:
        """``password``: the job's own redis-server requires one (kept out of the URL, which is
        shown and passed around); a password inside ``url`` wins over it."""
        if not JOB_NAME_PATTERN.match(job):
            raise ValueError(f"job name {job!r} must match {JOB_NAME_PATTERN.pattern} (it becomes a key prefix)")
        self.url = url
        self.job = job
        self.prefix = f"slime:{job}:"
        self._password = password
        # No automatic retries: resending a script after a dropped reply could append a chunk twice.
        self.redis = redis.Redis.from_url(
            url, socket_connect_timeout=10, retry=Retry(NoBackoff(), 0), password=password
        )

    # Ray actors and worker processes get their own connection from the same (url, job, password).
    def __reduce__(self) -> tuple:
        return (_reconnect, (self.url, self.job, self._password))

    def __repr__(self) -> str:
        return f"JobConnection(job={self.job!r}, url={redact_url(self.url)!r})"

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def server_time(self) -> float:
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def script(self, *files: str) -> Script:
        """A script of slime/buffer/lua/ (ARGV[1] is the job prefix), with prelude.lua in front."""
        return self.redis.register_script(lua_source("prelude.lua", *files))

    def close(self) -> None:
        self.redis.close()
