"""One job's keys on one Redis server: the client that the parts of the buffer share in a process,
the key prefix, the server's clock, and the Lua scripts (slime/buffer/lua/) with their reply codes.

Redis may go away (restarted, replaying its AOF): every command is retried with backoff for up to
``reconnect_timeout_s``. A state-changing script must then not run twice when its reply, not its
request, was lost: each call carries a request id, and the script stores its reply under it in the
same atomic step (`OnceScript`); a call sent again gets the stored reply and changes nothing.

A Redis Cluster (`redis+cluster://host:port`, any one node) serves the same scripts: every key of a
job carries the hash tag ``{job}``, so all of them lie in one slot and each script stays atomic on the
one master that owns it (one job's buffer is served by one master; the cluster spreads jobs and
gives failover). With ``replica_acks`` a state-changing script counts as stored only once that many
replicas have it (`WAIT` on the same connection): a master killed after the reply loses nothing
that was acknowledged, and its promoted replica carries on.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from enum import IntEnum
from functools import cache
from importlib import resources
from typing import TypeVar

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ExecAbortError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    TryAgainError,
)

from slime.buffer.retry import READ_TIMEOUT_S, backoff_s, reconnecting_retry
from slime.config import JobConfig
from slime.security import redact_url

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
T = TypeVar("T")
# buffer.url schemes of a Redis Cluster (any one node's address; the client finds the rest)
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
# Replies that mean "send it again, maybe to another node": the slot moved (a failover promoted a
# replica), the cluster is between states, or the server lacks the script (first use, restarted).
_SEND_AGAIN = (NoScriptError, MovedError, AskError, TryAgainError, ClusterDownError)
# What a failover (or a restart) looks like to a command: wait, learn the masters again, send again.
# (RedisClusterException is not a RedisError: the cluster client raises it when no node answers.)
FAILOVER_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    MovedError,
    AskError,
    TryAgainError,
    ClusterDownError,
    ExecAbortError,  # a MULTI whose commands were refused with MOVED
    RedisClusterException,
)


class ReplicaAckError(redis.RedisError):
    """Fewer replicas than ``buffer.replica_acks`` confirmed a write within its timeout: the write
    is on the master but does not count as stored."""


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def wait_out_failover(call: Callable[[], T], patience_s: float, before_retry: Callable[[], None] | None = None) -> T:
    """call(), made again with backoff while it fails as a failover does (FAILOVER_ERRORS), for up
    to ``patience_s``; ``before_retry`` runs before each new try (learn the masters again)."""
    deadline = time.monotonic() + patience_s
    attempt = 0
    while True:
        try:
            return call()
        except FAILOVER_ERRORS:
            if time.monotonic() > deadline:
                raise
            if before_retry is not None:
                before_retry()
            time.sleep(backoff_s(attempt))
            attempt += 1


class FailoverPatientCluster(RedisCluster):
    """A cluster client whose commands wait out a failover: redis-py's own retries come at once,
    one after another, and are spent long before a replica is promoted (seconds)."""

    patience_s: float = 0.0

    def execute_command(self, *args, **kwargs):
        return wait_out_failover(
            lambda: super(FailoverPatientCluster, self).execute_command(*args, **kwargs), self.patience_s
        )


def open_client(url: str, *, patience_s: float = 0.0, **kwargs) -> redis.Redis | RedisCluster:
    """A client for a buffer URL: `redis://`, `rediss://`, `unix://`, or a cluster's
    `redis+cluster://host:port` (`rediss+cluster://` with TLS). ``patience_s``: how long a cluster
    client's commands wait out a failover. Other keyword arguments go to redis-py."""
    if is_cluster_url(url):
        client = FailoverPatientCluster.from_url(url.replace("+cluster", "", 1), **kwargs)
        client.patience_s = patience_s
        return client
    return redis.Redis.from_url(url, **kwargs)


class ScriptReply(IntEnum):
    """Codes the per-sample scripts return as the first element of their reply."""

    OK = 0
    LEASE_LOST = -1
    BAD_CHUNK = -2
    STORED_MISMATCH = -3
    NO_SAMPLE = -4
    WRONG_STATUS = -5
    LOST_CHUNKS = -6  # append: the stored trajectory is shorter than the writer knows it to be


# Wrapped around a state-changing script: KEYS[1] names the call's stored reply (see OnceScript).
# cmsgpack, not cjson: replies hold raw token bytes.
_ONCE_HEAD = """local reply_ttl = tonumber(table.remove(ARGV))
local reply_key = KEYS[1]
local stored_reply = redis.call('GET', reply_key)
if stored_reply then
  -- A write that replicates: a WAIT after this resend then also covers the first run's writes.
  redis.call('EXPIRE', reply_key, reply_ttl)
  return cmsgpack.unpack(stored_reply)
end
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


def _reconnect(
    url: str, job: str, password: str | None, reconnect_timeout_s: float = 60.0, replica_acks: int = 0
) -> JobConnection:
    return JobConnection(
        url, job, password=password, reconnect_timeout_s=reconnect_timeout_s, replica_acks=replica_acks
    )


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
        """The EVALSHA arguments after the sha for one call: numkeys, one key (the reply key; else
        the job's anchor, which names the slot on a cluster), ARGV."""
        if not self.stores_reply:
            return (1, self.connection.anchor, *args)
        return (1, self.connection.key("reply", uuid.uuid4().hex), *args, self.connection.reply_ttl_s)

    def __call__(self, args: Sequence):
        return ScriptBatch(self, [list(args)]).replies()[0]

    def load(self) -> None:
        """Load the script into the server that holds the job's keys (a cluster: the slot's master)."""
        self.connection.node_client().script_load(self.script)


class JobScript:
    """A script called plainly through the client (reads, and the dashboard's rare writes): the
    job's anchor is its one key, so a cluster client sends it to the node that holds the job."""

    def __init__(self, connection: JobConnection, script: Script) -> None:
        self.connection, self._script = connection, script
        self.script, self.sha = script.script, script.sha

    def __call__(self, args: Sequence, client: JobPipeline | None = None):
        if client is not None:
            client.queue_script(self._script, [self.connection.anchor], list(args))
            return client
        return self._script(keys=[self.connection.anchor], args=args)


class JobPipeline:
    """Commands of one job queued for one round trip (``pipe.hget(...)``, as on a redis-py pipeline),
    sent by ``execute()`` to the server that holds the job's keys: on a cluster a plain pipeline
    on the slot's master, so the scripts in it are loaded first and TIME is that server's clock. A
    failover or a lost connection sends them all again, on a fresh pipeline to the master then,
    with backoff, for up to the connection's reconnect_timeout_s (a MULTI/EXEC pipeline ran all or
    nothing; the others are reads, or telemetry that may then show twice)."""

    def __init__(self, connection: JobConnection, transaction: bool) -> None:
        self.connection, self.transaction = connection, transaction
        self.queued: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, command: str):
        def queue(*args, **kwargs) -> JobPipeline:
            self.queued.append((command, args, kwargs))
            return self

        return queue

    def queue_script(self, script: Script, keys: list, args: list) -> None:
        self.queued.append(("", (script, keys, args), {}))

    def execute(self) -> list:
        return self.connection.on_job_server(self._send)

    def _send(self, client: redis.Redis) -> list:
        pipe = client.pipeline(transaction=self.transaction)
        for command, args, kwargs in self.queued:
            if command:
                getattr(pipe, command)(*args, **kwargs)
            else:
                script, keys, script_args = args
                script(keys=keys, args=script_args, client=pipe)
        return pipe.execute()


class ScriptBatch:
    """Calls of one OnceScript sent as EVALSHA in one pipeline, on one connection to the node that
    holds the job's keys, replies not read yet (redis-py's pipelines of Script calls ask SCRIPT
    EXISTS first: one more round trip). With replica acknowledgement a WAIT follows on the same
    connection, so it waits for exactly these writes.

    ``replies()`` reads them (once). A server without the script answers NOSCRIPT: the script is
    loaded and the calls it refused are sent again. A connection lost on the way (Redis restarting,
    a master killed), or a slot that moved (its replica promoted), sends every call not yet
    acknowledged again, with backoff, for up to the connection's reconnect_timeout_s: the scripts
    are OnceScripts (or check what is stored), so a call that had run answers as it did.
    """

    def __init__(self, script: OnceScript, calls: list[list]) -> None:
        self.script, self.connection = script, script.connection
        self.commands = [("EVALSHA", script.sha, *script.call_args(args)) for args in calls]
        self.deadline = time.monotonic() + self.connection.reconnect_timeout_s
        self._sent = None
        if self.commands:
            try:
                self._sent = self._send(self.commands)
            except (redis.ConnectionError, redis.TimeoutError):
                pass  # sent again by replies(), until the deadline

    def _send(self, commands: list[tuple]):
        client = self.connection.node_client()
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands(commands + self.connection.wait_commands()))
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        return client, connection

    def _read(self, sent, n: int) -> list:
        """n replies, then the replica acknowledgement; a reply that asks to send again is returned
        in its call's place."""
        client, connection = sent
        replies: list = []
        try:
            for _ in range(n):
                try:
                    replies.append(connection.read_response())
                except _SEND_AGAIN as exc:
                    replies.append(exc)
            if not self._await_replicas(connection, any(not isinstance(r, Exception) for r in replies)):
                # The node turned replica under us (a failover): whether it kept the writes is
                # unknown, so every call is sent again to the new master (each is safe to resend).
                replies = [TryAgainError("the node became a replica") for _ in replies]
        except BaseException:
            connection.disconnect()  # replies half read: the connection cannot be reused
            raise
        finally:
            client.connection_pool.release(connection)
        return replies

    def _await_replicas(self, connection, wrote: bool) -> bool:
        """Read the WAIT reply (and WAIT again while replicas lag, up to the deadline); False when
        the node can no longer take WAIT: it is a replica now."""
        wanted = self.connection.replica_acks
        if not wanted:
            return True
        while True:
            try:
                acked = int(connection.read_response())
            except redis.ResponseError:  # "WAIT cannot be used with replica instances"
                return not wrote
            if not wrote or acked >= wanted:
                return True
            if time.monotonic() > self.deadline:
                raise ReplicaAckError(
                    f"job {self.connection.job!r}: {acked} of the {wanted} replicas required (buffer.replica_acks) "
                    f"confirmed a write within {self.connection.reconnect_timeout_s:.0f} s"
                )
            connection.send_command("WAIT", wanted, self.connection.replica_ack_timeout_ms)

    def replies(self) -> list:
        if not self.commands:  # a worker step with nothing to write: no round trip
            return []
        sent, self._sent = self._sent, None
        replies: list = [None] * len(self.commands)
        unanswered = list(range(len(self.commands)))
        attempt, loads = 0, 0
        while True:
            try:
                if sent is None:
                    sent = self._send([self.commands[i] for i in unanswered])
                got = self._read(sent, len(unanswered))
            except (redis.ConnectionError, redis.TimeoutError, RedisClusterException):  # also LOADING (AOF replay)
                sent = None
                if time.monotonic() > self.deadline:
                    raise
                self.connection.refresh_slots()
                time.sleep(backoff_s(attempt))
                attempt += 1
                continue
            sent = None
            again = []
            for i, reply in zip(unanswered, got):
                if isinstance(reply, _SEND_AGAIN):
                    again.append((i, reply))
                else:
                    replies[i] = reply
            if not again:
                return replies
            unanswered = [i for i, _ in again]
            moved = [reply for _, reply in again if not isinstance(reply, NoScriptError)]
            if moved and time.monotonic() > self.deadline:
                raise moved[0]
            if len(moved) < len(again):
                loads += 1
                if loads > 3:  # loaded, and still refused: the script goes somewhere else than its load
                    raise next(reply for _, reply in again if isinstance(reply, NoScriptError))
                try:
                    self.script.load()
                except FAILOVER_ERRORS:
                    pass  # the calls are sent again; a failover shows there
            if moved:
                self.connection.refresh_slots()
                time.sleep(backoff_s(attempt))
                attempt += 1


class JobConnection:
    """The Redis client and key prefix of one job; the store, the telemetry and the dashboard's
    queries of one process share one (`TrajectoryStore(connection)`, `JobTelemetry(connection)`)."""

    def __init__(
        self,
        url: str,
        job: str,
        *,
        password: str | None = None,
        reconnect_timeout_s: float = 60.0,
        replica_acks: int = 0,
    ) -> None:
        """``password``: the job's own redis-server requires one (kept out of the URL, which is
        shown and passed around); a password inside ``url`` wins over it. ``reconnect_timeout_s``:
        how long a command waits for a Redis that went away (see the module docstring).
        ``replica_acks``: replicas that must confirm each state-changing script (0: none)."""
        if not JOB_NAME_PATTERN.match(job):
            raise ValueError(f"job name {job!r} must match {JOB_NAME_PATTERN.pattern} (it becomes a key prefix)")
        if replica_acks < 0:
            raise ValueError(f"replica_acks must be >= 0, got {replica_acks}")
        self.url = url
        self.job = job
        self.cluster = is_cluster_url(url)
        # On a cluster the hash tag puts every key of the job in one slot (one master runs each
        # script); a standalone server keeps the layout older jobs were written in.
        self.prefix = f"slime:{{{job}}}:" if self.cluster else f"slime:{job}:"
        self.anchor = self.key("anchor")  # a key of the job's slot, never written: routes keyless calls
        self._password = password
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.replica_acks = int(replica_acks)
        self.replica_ack_timeout_ms = 1000
        # A stored reply outlives every retry of its call.
        self.reply_ttl_s = max(60, math.ceil(2 * self.reconnect_timeout_s))
        retry = reconnecting_retry(self.reconnect_timeout_s)
        # A read that never ends (a stopped server) fails after READ_TIMEOUT_S and is retried like a
        # lost connection: without a read timeout the job hung, deaf to SIGTERM, on a stopped Redis.
        self.redis = open_client(
            url,
            patience_s=self.reconnect_timeout_s,
            socket_connect_timeout=10,
            socket_timeout=max(5.0, min(READ_TIMEOUT_S, self.reconnect_timeout_s)),  # > a replica WAIT (1 s)
            retry=retry,
            password=password,
        )

    @classmethod
    def of_job(cls, cfg: JobConfig, url: str, password: str | None) -> JobConnection:
        """The connection every part of a running job opens: its job name and buffer settings."""
        return cls(
            url,
            cfg.job_name,
            password=password,
            reconnect_timeout_s=cfg.buffer.reconnect_timeout_s,
            replica_acks=cfg.buffer.replica_acks,
        )

    # Ray actors and worker processes get their own connection from the same settings.
    def __reduce__(self) -> tuple:
        return (_reconnect, (self.url, self.job, self._password, self.reconnect_timeout_s, self.replica_acks))

    def __repr__(self) -> str:
        return f"JobConnection(job={self.job!r}, url={redact_url(self.url)!r})"

    def node_client(self) -> redis.Redis:
        """The client of the server that holds the job's keys (on a cluster: the slot's master now)."""
        if not self.cluster:
            return self.redis
        node = self.redis.get_node_from_key(self.anchor)
        if node.redis_connection is None:
            self.redis.nodes_manager.create_redis_connections([node])
        return node.redis_connection

    def refresh_slots(self) -> None:
        """After a lost connection or a MOVED reply: learn the cluster's masters again."""
        if self.cluster:
            try:
                self.redis.nodes_manager.initialize()
            except (redis.RedisError, RedisClusterException):
                pass  # the cluster is between states: the caller backs off and tries again

    def wait_commands(self) -> list[tuple]:
        """What follows a batch of writes on the same connection: WAIT for the required replicas."""
        return [("WAIT", self.replica_acks, self.replica_ack_timeout_ms)] if self.replica_acks else []

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def server_time(self) -> float:
        """The clock of the server that holds the job's keys, which the scripts' leases run on."""
        seconds, micros = self.on_job_server(lambda client: client.time())
        return seconds + micros / 1e6

    def on_job_server(self, call: Callable[[redis.Redis], T]) -> T:
        """call(client of the server that holds the job's keys). On a cluster a failover is waited
        out: the masters are learned again and the call made again, with backoff, for up to
        reconnect_timeout_s (a standalone client has retried by itself: its Retry)."""
        if not self.cluster:
            return call(self.redis)
        return wait_out_failover(lambda: call(self.node_client()), self.reconnect_timeout_s, self.refresh_slots)

    def pipeline(self, transaction: bool = False) -> JobPipeline:
        """Commands of this job for one round trip (`JobPipeline`)."""
        return JobPipeline(self, transaction)

    def script(self, *files: str) -> JobScript:
        """A script of slime/buffer/lua/ called plainly (ARGV[1] is the job prefix), prelude.lua in front."""
        return JobScript(self, self.redis.register_script(lua_source("prelude.lua", *files)))

    def once_script(self, *files: str, stores_reply: bool = True) -> OnceScript:
        """A state-changing script of slime/buffer/lua/, taking effect once per call (OnceScript)."""
        body = lua_source("prelude.lua", *files)
        if not stores_reply:
            return OnceScript(self, self.redis.register_script(body), stores_reply=False)
        return OnceScript(self, self.redis.register_script(_ONCE_HEAD + body + _ONCE_TAIL))

    def close(self) -> None:
        self.redis.close()
