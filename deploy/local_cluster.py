"""A Ray cluster of several nodes on this machine (this machine's address), each with custom resources: what the
multi-node tests place learner ranks and rollout workers on, and a way to try a cluster job by hand.

    python deploy/local_cluster.py --node learner_node=2 --node rollout_node=2
    # prints "address: 127.0.0.1:PORT" (the GCS, for ray.init) and "dashboard: http://IP:PORT" (the Jobs
    # API), then serves until SIGINT/SIGTERM, which stops every node
    slime train cfg.yaml cluster.ray_address=127.0.0.1:PORT learner.resources_per_rank='{learner_node: 1}' \\
        rollout.resources_per_worker='{rollout_node: 1}'
    slime submit cfg.yaml --address http://IP:PORT   # the same job through the Jobs API (docs/cluster.md)

Each `--node` is one Ray node (its own raylet and object store; the first is the head, with the
dashboard the state API reads) with `--cpus` CPUs and the given custom resources.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path


def parse_node(text: str) -> dict[str, float]:
    """'learner_node=2,gpu_like=1' -> {'learner_node': 2.0, 'gpu_like': 1.0}; '' -> {}."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        name, _, amount = part.partition("=")
        if not name or not amount:
            raise SystemExit(f"--node {text!r}: expected name=amount[,name=amount]")
        out[name.strip()] = float(amount)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node", action="append", default=[], help="custom resources of one node (repeat)")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs each node offers")
    args = parser.parse_args()
    nodes = [parse_node(n) for n in args.node] or [{}]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only: nothing else can reach it
    # A submitted job's command runs `python` from the nodes' PATH: this interpreter, with slime's dependencies.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    from ray.cluster_utils import Cluster

    # Every node's dashboard agent takes a free port of its own: Ray's default (52365) is one per
    # machine, and a second node on it (or any other Ray here) would leave the Jobs API without an agent.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.cpus,
            "resources": nodes[0],
            "include_dashboard": True,
            "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(),
        },
    )
    for resources in nodes[1:]:
        cluster.add_node(num_cpus=args.cpus, resources=resources, dashboard_agent_listen_port=free_port())
    cluster.wait_for_nodes()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"address: {cluster.address}", flush=True)
    print(f"dashboard: http://{cluster.webui_url}", flush=True)
    try:
        stop.wait()
    finally:
        cluster.shutdown()
    print("stopped", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
