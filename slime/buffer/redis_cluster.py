"""A real Redis Cluster on this machine's loopback: masters with their replicas, each a
`redis-server --cluster-enabled yes` process of its own (what the cluster tests and
benchmarks/buffer_scale.py run the buffer on, and a way to try `buffer.url=redis+cluster://...`).

    with LocalRedisCluster(tmp_dir, masters=3, replicas=1) as cluster:
        store = TrajectoryStore.open(cluster.url, "job")   # redis+cluster://127.0.0.1:PORT

The slots are dealt evenly to the masters (CLUSTER ADDSLOTS), the nodes meet, each replica follows
its master (CLUSTER REPLICATE), and the cluster is ready when every node reports `cluster_state:ok`
and every replica's link is up. With a short node timeout a killed master's replica is promoted
within a few seconds (`kill_master_of`).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from slime.buffer.aof import cut_open_transaction
from slime.buffer.redis_server import _log_tail, find_redis_server
from slime.security import private_dir, write_private

SLOT_COUNT = 16384
BUS_PORT_OFFSET = 10000  # each node also listens on port + 10000 for the cluster bus


def _free_node_port() -> int:
    """A port free on loopback whose cluster-bus port (port + 10000, at most 65535) is free too."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for candidate in (port, port + BUS_PORT_OFFSET):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) for a cluster node")


class ClusterNode:
    """One redis-server of the cluster: its port, process and role."""

    def __init__(self, port: int, data_dir: Path, process: subprocess.Popen) -> None:
        self.port, self.data_dir, self.process = port, data_dir, process

    def client(self, password: str | None) -> redis.Redis:
        return redis.Redis(port=self.port, password=password, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def alive(self) -> bool:
        return self.process.poll() is None


class LocalRedisCluster:
    """``masters`` masters with ``replicas`` replicas each on 127.0.0.1 (started at construction;
    `stop` or the context manager ends every process). ``password``: requirepass and masterauth of
    every node. ``node_timeout_ms``: how long a master is unreachable before a replica takes over."""

    def __init__(
        self,
        data_dir: Path | str,
        masters: int = 3,
        replicas: int = 1,
        password: str | None = None,
        node_timeout_ms: int = 1000,
        ready_timeout_s: float = 30.0,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"a cluster needs >= 1 master and >= 0 replicas, got {masters} and {replicas}")
        self.data_dir = private_dir(Path(data_dir))
        self.password = password
        self.node_timeout_ms = int(node_timeout_ms)
        self.binary = find_redis_server()
        self.nodes: list[ClusterNode] = []
        try:
            for _ in range(masters * (1 + replicas)):
                self.nodes.append(self._start_node())
            self._form(masters, replicas, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The buffer URL (the first node's address; the client learns the rest). No password in it."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def _start_node(self, port: int | None = None) -> ClusterNode:
        port = port or _free_node_port()
        node_dir = private_dir(self.data_dir / f"node-{port}")
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            f"dir {node_dir}",
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {self.node_timeout_ms}",
            "appendonly yes",
            "appendfsync everysec",
            "save ''",
            "maxmemory-policy noeviction",
            f"logfile {node_dir / 'redis-server.log'}",
        ]
        if self.password:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        config = node_dir / "redis.conf"
        write_private(config, "\n".join(lines) + "\n")
        cut_open_transaction(node_dir)  # a restarted node: a block its killed server left half written
        process = subprocess.Popen(
            [self.binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        node = ClusterNode(port, node_dir, process)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not node.alive():
                raise RuntimeError(
                    f"redis-server (cluster node :{port}) exited: {_log_tail(node_dir / 'redis-server.log')}"
                )
            try:
                node.client(self.password).ping()
                return node
            except redis.ConnectionError:
                time.sleep(0.05)
        process.kill()
        raise RuntimeError(f"redis-server (cluster node :{port}) did not answer within 10 s")

    def _form(self, masters: int, replicas: int, ready_timeout_s: float) -> None:
        clients = [node.client(self.password) for node in self.nodes]
        per_master = SLOT_COUNT // masters
        for m in range(masters):
            end = SLOT_COUNT if m == masters - 1 else (m + 1) * per_master
            clients[m].execute_command("CLUSTER ADDSLOTS", *range(m * per_master, end))
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + ready_timeout_s
        master_ids = [c.execute_command("CLUSTER MYID").decode() for c in clients[:masters]]
        # A node must know a master before it can follow it.
        while any(_known_nodes(c) < len(self.nodes) for c in clients):
            self._wait(deadline, "every node to know every other")
        for r, client in enumerate(clients[masters:]):
            client.execute_command("CLUSTER REPLICATE", master_ids[r % masters])
        while not all(_state_ok(c) for c in clients) or not all(_link_up(c) for c in clients[masters:]):
            self._wait(deadline, "cluster_state:ok on every node and every replica's link up")

    def _wait(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis Cluster in {self.data_dir}: timed out waiting for {what}")
        time.sleep(0.1)

    def master_of(self, key: str) -> ClusterNode:
        """The node that serves ``key``'s slot now."""
        for node in self.nodes:
            if not node.alive():
                continue
            try:
                slot = node.client(self.password).execute_command("CLUSTER KEYSLOT", key)
                _, host_port = _slot_owner(node.client(self.password), int(slot))
            except redis.RedisError:
                continue
            return next(n for n in self.nodes if n.port == host_port)
        raise RuntimeError("no live cluster node answers")

    def kill_master_of(self, key: str) -> ClusterNode:
        """SIGKILL the master that serves ``key`` (no shutdown, no final AOF write). Returns it."""
        node = self.master_of(key)
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)
        return node

    def restart(self, node: ClusterNode) -> ClusterNode:
        """Start a stopped node again on its port and data (its nodes.conf and AOF): it rejoins, as a
        replica of whichever node took over its slots. Returns the new node (same port)."""
        if node.alive():
            raise RuntimeError(f"cluster node :{node.port} is still running")
        fresh = self._start_node(node.port)
        self.nodes[self.nodes.index(node)] = fresh
        return fresh

    def wait_for_new_master(self, key: str, old: ClusterNode, timeout_s: float = 30.0) -> ClusterNode:
        """Wait until a live node (the promoted replica) serves ``key`` and the cluster is ok."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                node = self.master_of(key)
                if node is not old and node.alive() and _state_ok(node.client(self.password)):
                    return node
            except RuntimeError:
                pass
            self._wait(deadline, f"a replica to take over from :{old.port}")

    def stop(self) -> None:
        """SIGKILL every node: a throwaway cluster (a SIGTERMed Redis 7 master waits up to 10 s for
        replicas that are stopping too); the AOFs stay in data_dir."""
        for node in self.nodes:
            if node.alive():
                try:
                    os.killpg(node.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for node in self.nodes:
            node.process.wait(timeout=10)
            if node.process.stderr:
                node.process.stderr.close()

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _known_nodes(client: redis.Redis) -> int:
    return int(_cluster_info(client).get("cluster_known_nodes", 0))


def _state_ok(client: redis.Redis) -> bool:
    try:
        return _cluster_info(client).get("cluster_state") == "ok"
    except redis.RedisError:
        return False


def _link_up(client: redis.Redis) -> bool:
    return client.info("replication").get("master_link_status") == "up"


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
    return {str(k): str(v) for k, v in info.items()}


def _slot_owner(client: redis.Redis, slot: int) -> tuple[str, int]:
    """(host, port) of the master serving ``slot``, as this node sees it."""
    for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
        if int(start) <= slot <= int(end):
            host = master[0].decode() if isinstance(master[0], bytes) else master[0]
            return host, int(master[1])
    raise RuntimeError(f"slot {slot} is not served")
