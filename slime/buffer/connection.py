"""One job's keys on one Redis server: the client that the parts of the buffer share in a process,
the key prefix, the server's clock, and the Lua scripts (slime/buffer/lua/) with their reply codes.

Redis may go away (restarted, replaying its AOF): every command is retried with backoff for up to
``reconnect_timeout_s``. A state-changing script must then not run twice when its reply, not its
request, was lost: each call carries a request id, and the script stores its reply under it in the
same atomic step (`OnceScript`); a call sent again gets the stored reply and changes nothing.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from enum import IntEnum
from functools import cache
from importlib import resources

import redis
from redis.backoff import ExponentialBackoff
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
    LOST_CHUNKS = -6  # append: the stored trajectory is shorter than the writer knows it to be


BACKOFF_BASE_S, BACKOFF_CAP_S = 0.02, 1.0
# Wrapped around a state-changing script: KEYS[1] names the call's stored reply (see OnceScript).
# cmsgpack, not cjson: replies hold raw token bytes.
_ONCE_HEAD = """local reply_ttl = tonumber(table.remove(ARGV))
local reply_key = KEYS[1]
local stored_reply = redis.call('GET', reply_key)
if stored_reply then return cmsgpack.unpack(stored_reply) end
local reply = (function()
"""
_ONCE_TAIL = """
end)()
redis.call('SET', reply_key, cmsgpack.pack(reply), 'EX', reply_ttl)
return reply
"""


@cache
def lua_source(*files: str) -> str:
    """The named files of slime/buffer/lua/, concatenated in order (helpers before the script)."""
    folder = resources.files("slime.buffer").joinpath("lua")
    return "\n".join(folder.joinpath(name).read_text() for name in files)


def _reconnect(url: str, job: str, password: str | None, reconnect_timeout_s: float = 60.0) -> JobConnection:
    return JobConnection(url, job, password=password, reconnect_timeout_s=reconnect_timeout_s)


def backoff_s(attempt: int) -> float:
    """The wait after failure ``attempt``: doubling from BACKOFF_BASE_S, capped at BACKOFF_CAP_S."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)


def reconnecting_retry(timeout_s: float) -> Retry:
    """Retries on a lost connection (and on LOADING while Redis replays its AOF) with exponential
    backoff capped at BACKOFF_CAP_S, as many as fit in ``timeout_s`` of waiting."""
    retries, waited = 0, 0.0
    while waited < timeout_s:
        retries += 1
        waited += backoff_s(retries)  # redis-py waits backoff(failures) after failure 1, 2, ...
    return Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries=retries)


class OnceScript:
    """A state-changing script that takes effect at most once per call, however often the call is
    sent. By default each call gets a fresh request id (`call_args`) and the script stores its reply
    under it for ``reply_ttl_s`` (the last ARGV, taken off before the script runs), longer than any
    retry lasts. A script that makes a resend harmless by itself (``stores_reply=False``: the chunk
    append, which checks the stored length) is called plainly: the hot path pays nothing."""

    def __init__(self, connection: JobConnection, script: Script, stores_reply: bool = True) -> None:
        self.connection, self._script, self.stores_reply = connection, script, stores_reply
        self.script, self.sha = script.script, script.sha  # the source and its digest, as Script has them

    def call_args(self, args: Sequence) -> tuple:
        """The EVALSHA arguments after the sha for one call: numkeys, its reply key, ARGV."""
        if not self.stores_reply:
            return (0, *args)
        return (1, self.connection.key("reply", uuid.uuid4().hex), *args, self.connection.reply_ttl_s)

    def __call__(self, args: Sequence):
        numkeys, *rest = self.call_args(args)
        return self._script(keys=rest[:numkeys], args=rest[numkeys:])

    def load(self) -> None:
        self.connection.redis.script_load(self.script)


class JobConnection:
    """The Redis client and key prefix of one job; the store, the telemetry and the dashboard's
    queries of one process share one (`TrajectoryStore(connection)`, `JobTelemetry(connection)`)."""

    def __init__(self, url: str, job: str, *, password: str | None = None, reconnect_timeout_s: float = 60.0) -> None:
        """``password``: the job's own redis-server requires one (kept out of the URL, which is
        shown and passed around); a password inside ``url`` wins over it. ``reconnect_timeout_s``:
        how long a command waits for a Redis that went away (see the module docstring)."""
        if not JOB_NAME_PATTERN.match(job):
            raise ValueError(f"job name {job!r} must match {JOB_NAME_PATTERN.pattern} (it becomes a key prefix)")
        self.url = url
        self.job = job
        self.prefix = f"slime:{job}:"
        self._password = password
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        # A stored reply outlives every retry of its call.
        self.reply_ttl_s = max(60, math.ceil(2 * self.reconnect_timeout_s))
        self.redis = redis.Redis.from_url(
            url, socket_connect_timeout=10, retry=reconnecting_retry(self.reconnect_timeout_s), password=password
        )

    # Ray actors and worker processes get their own connection from the same (url, job, password).
    def __reduce__(self) -> tuple:
        return (_reconnect, (self.url, self.job, self._password, self.reconnect_timeout_s))

    def __repr__(self) -> str:
        return f"JobConnection(job={self.job!r}, url={redact_url(self.url)!r})"

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def server_time(self) -> float:
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def script(self, *files: str) -> Script:
        """A read-only script of slime/buffer/lua/ (ARGV[1] is the job prefix), prelude.lua in front."""
        return self.redis.register_script(lua_source("prelude.lua", *files))

    def once_script(self, *files: str, stores_reply: bool = True) -> OnceScript:
        """A state-changing script of slime/buffer/lua/, taking effect once per call (OnceScript)."""
        body = lua_source("prelude.lua", *files)
        if not stores_reply:
            return OnceScript(self, self.redis.register_script(body), stores_reply=False)
        return OnceScript(self, self.redis.register_script(_ONCE_HEAD + body + _ONCE_TAIL))

    def close(self) -> None:
        self.redis.close()
