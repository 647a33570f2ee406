"""The buffer API under load, and what a polling dashboard costs the job.

1. API latency: 100k trajectories written straight into a fresh Redis through the buffer's own
   add_group script and pipelined per-token arrays (statuses, lengths 1..128, versions, rewards
   drawn at random). `slime dashboard` serves them from its own process; a loopback load generator
   (raw HTTP/1.1 keep-alive connections, closed loop like wrk, `--seconds` per endpoint) measures the
   summary, the first page of the list, a deep page (cursor in the middle), a filtered page and one
   trajectory, with 1 and with 4 concurrent connections. Target: summary and list p99 < 50 ms with
   one connection sending back to back (hundreds of requests per second; a page polls ~1/s).
2. Rollout throughput: one short real job (sync GRPO + APRIL, tiny MoE, dashboard.enabled=true in
   the driver) whose steps 1, 2, 5, 6, ... (ABBA) are rolled out while a poller process (niced:
   browsers do not run on the training node) loads the API like ten open pages (ten summaries a
   second as ten live streams would, ten page refreshes every 3 s, the step history per step, a
   Prometheus scrape a second) and whose other steps run with nobody polling; median rollout
   tokens/s of each. Target: within 5%.

Prints a table, then LAST one JSON line.   python benchmarks/dashboard_api.py [--trajectories 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from slime.buffer.connection import ScriptBatch  # noqa: E402
from slime.buffer.records import WIRE_LOGPROB, WIRE_MASK, WIRE_TOKEN, WIRE_VERSION  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.buffer.store import TrajectoryStore  # noqa: E402
from slime.config import load_config  # noqa: E402
from slime.sample import new_id  # noqa: E402
from slime.train import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STATUSES = ["completed", "truncated", "failed", "aborted", "pending"]
STATUS_P = [0.70, 0.10, 0.05, 0.10, 0.05]


def fill(buffer: TrajectoryStore, n_trajectories: int, group_size: int = 4, seed: int = 0) -> float:
    """n_trajectories samples in n/group_size groups, with tokens; returns seconds taken."""
    rng = np.random.default_rng(seed)
    t0 = time.time()
    counts = dict.fromkeys(STATUSES, 0)
    n_groups = n_trajectories // group_size
    batch = 500
    for start in range(0, n_groups, batch):
        pipe = buffer.redis.pipeline(transaction=False)
        groups, calls = [], []
        for _ in range(min(batch, n_groups - start)):
            gid, sids = new_id(), [new_id() for _ in range(group_size)]
            groups.append(sids)
            prompt = rng.integers(6, 60, 24).astype(WIRE_TOKEN).tobytes()
            metadata = json.dumps({"prompt_text": "bench"})
            no_draw, not_streaming = "", ""
            calls.append([buffer.prefix, gid, group_size, 128, prompt, metadata, no_draw, not_streaming, *sids])
        ScriptBatch(buffer._add_group, calls).replies()  # the groups, in one round trip
        for sids in groups:
            for sid in sids:
                status = rng.choice(STATUSES, p=STATUS_P)
                counts[status] += 1
                key = buffer._key("sample", sid)
                if status == "pending":
                    continue
                n = int(rng.integers(1, 129))
                first = int(rng.integers(0, 20))
                versions = np.sort(first + rng.integers(0, 3, n)).astype(WIRE_VERSION)
                pipe.set(key + ":tok", rng.integers(6, 60, n).astype(WIRE_TOKEN).tobytes())
                pipe.set(key + ":lp", (-rng.random(n)).astype(WIRE_LOGPROB).tobytes())
                pipe.set(key + ":ver", versions.tobytes())
                pipe.set(key + ":mask", np.ones(n, WIRE_MASK).tobytes())
                fields = {"status": status}
                if status in ("completed", "truncated"):
                    fields["reward"] = repr(float(rng.random()))
                if status == "failed":
                    fields["failure"] = "reward timed out after 30s"
                pipe.hset(key, mapping=fields)
        pipe.execute()
    # The add_group script counted every sample as pending; set the real numbers.
    buffer.redis.hset(buffer._key("status_counts"), mapping=counts)
    buffer.set_policy_version(22)
    return time.time() - t0


async def _load(url: str, path_fn, clients: int, seconds: float) -> list[float]:
    """Closed-loop load like wrk: `clients` keep-alive connections, each sending its next request as
    soon as the last answer is read. Raw HTTP/1.1 on asyncio streams, so the generator itself costs
    little CPU on a small machine (an HTTP client library would cost more than the server)."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    warm_until = time.perf_counter() + min(1.0, seconds)  # the first second is not recorded (connections, caches)
    deadline = warm_until + seconds

    async def one() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                writer.write(f"GET {path_fn()} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1]
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                if t >= warm_until:
                    latencies.append(time.perf_counter() - t)
                if status != b"200":
                    raise RuntimeError(f"{path_fn()}: {status.decode()} {body[:200]!r}")
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return latencies


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000.0, q))


def api_latency(n: int, clients_list: list[int], seconds: float) -> dict:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="dash-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    server = LocalRedisServer(tmp, aof=False)
    job = "bench"
    buffer = TrajectoryStore.open(server.url, job)
    fill_s = fill(buffer, n)
    print(f"filled {n} trajectories in {fill_s:.1f} s ({buffer.counts()['groups_total']} groups)", flush=True)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime.cli", "dashboard", "--redis", server.url, "--job", job, "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/api/summary", 60)
        mid = httpx.get(url + "/api/trajectories", params={"limit": 1}).json()["next_cursor"]
        rank = int(mid.split(".")[0]) // 2
        some_id = httpx.get(url + "/api/trajectories", params={"limit": 1, "cursor": f"{rank}.0"}).json()["items"][0][
            "id"
        ]
        cases = {
            "summary": lambda: "/api/summary",
            "list_first_page": lambda: "/api/trajectories?limit=50",
            "list_deep_page": lambda: f"/api/trajectories?limit=50&cursor={rank}.0",
            "list_filtered": lambda: "/api/trajectories?limit=50&status=failed&min_length=64",
            "trajectory": lambda: f"/api/trajectories/{some_id}",
        }
        out = {}
        for clients in clients_list:
            for name, path_fn in cases.items():
                lat = asyncio.run(_load(url, path_fn, clients, seconds))
                key = f"{name}_c{clients}"
                out[key] = {
                    "p50_ms": _pct(lat, 50),
                    "p99_ms": _pct(lat, 99),
                    "requests": len(lat),
                    "per_s": len(lat) / seconds,
                }
                print(
                    f"  {clients} client(s) {name:16s} p50 {out[key]['p50_ms']:6.1f} ms  "
                    f"p99 {out[key]['p99_ms']:6.1f} ms  {out[key]['per_s']:6.0f} req/s",
                    flush=True,
                )
        return {"fill_s": fill_s, "endpoints": out}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        server.stop()


POLLER = r"""
import os, sys, time, httpx
from pathlib import Path
os.nice(19)  # the browsers' side: on a real cluster it is not on the training node at all
url, metrics, steps, poll = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
PAGE = ("/api/histograms?window=500&bins=20", "/api/engines", "/api/experts", "/api/trajectories?limit=50")
if poll == "summary":  # only the ten live summaries a second
    PAGE, STEPS = (), False
else:
    STEPS = True
n, last_summary, last_page, last_scrape, last_steps = 0, 0.0, 0.0, 0.0, -1
with httpx.Client(base_url=url, timeout=10) as c:
    while True:
        logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if logged >= steps:
            break
        if logged % 4 not in (1, 2):  # steps 1, 2, 5, 6, ... are rolled out while ten pages poll (ABBA)
            time.sleep(0.02)
            continue
        try:  # what ten open pages ask: a live summary each second each, a refresh every 3 s each,
            # the step history when a step ends, and a Prometheus scrape every second
            now = time.time()
            if now - last_summary >= 0.1:
                c.get("/api/summary"); n += 1
                last_summary = now
            if now - last_page >= 0.3:
                for p in PAGE:
                    c.get(p); n += 1
                last_page = now
            if PAGE and now - last_scrape >= 1.0:
                c.get("/metrics"); n += 1
                last_scrape = now
            if STEPS and logged != last_steps:  # each page fetches the steps it has not seen
                for _ in range(10):
                    c.get(f"/api/steps?limit=500&since_step={max(-1, last_steps - 1)}"); n += 1
                last_steps = logged
        except httpx.HTTPError:
            pass  # the job is starting or stopping its dashboard
        time.sleep(0.01)
print(n)
"""


def rollout_overhead(steps: int, poll: str = "pages", shape: list[str] | None = None) -> dict:
    """One real job; the poller loads the API during the rollouts of steps 1, 2, 5, 6, ... only (it watches the job's
    metrics.jsonl), so both conditions share the job, its warm-up and the machine's load swings."""
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="dash-bench-job-"))
    atexit.register(shutil.rmtree, tmp, True)
    server = LocalRedisServer(tmp / "redis", aof=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = _free_port()
    try:
        cfg = load_config(
            None,
            [
                "job_name=bench-rollout",
                f"output_dir={tmp / 'run'}",
                f"buffer.url={server.url}",
                f"steps={steps}",
                "april.enabled=true",
                "april.oversample=2",
                "rollout.batch_size=4",
                "rollout.n_samples_per_prompt=4",
                "rollout.max_new_tokens=64",
                "data.num_generated=256",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "weights.check_every=0",
                "dashboard.enabled=true",
                f"dashboard.port={port}",
                *(shape or []),
            ],
        )
        poller = subprocess.Popen(
            [
                sys.executable,
                "-c",
                POLLER,
                f"http://127.0.0.1:{port}",
                str(tmp / "run" / "metrics.jsonl"),
                str(steps),
                poll,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        history = train(cfg)
        try:  # it stops by itself once the job's dashboard is gone
            out, _ = poller.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            poller.kill()
            out, _ = poller.communicate()
    finally:
        ray.shutdown()
        server.stop()
    per_step = {"without": [], "with": []}
    for h in history[2:]:  # steps 0 and 1: warm-up
        per_step["with" if int(h["step"]) % 4 in (1, 2) else "without"].append(h["rollout_tokens_per_s"])
    without, with_ = statistics.median(per_step["without"]), statistics.median(per_step["with"])
    for name, values in per_step.items():
        print(
            f"  {name:8s} polling: median {statistics.median(values):7.1f} tok/s over {len(values)} steps "
            f"(min {min(values):.0f}, max {max(values):.0f})",
            flush=True,
        )
    return {
        "without_tokens_per_s": without,
        "with_tokens_per_s": with_,
        # With APRIL a step whose batch was already full when it began generates nothing in its
        # own window (0 tok/s); a smoke run of one step per arm can meet that.
        "ratio": with_ / without if without > 0 else None,
        "steps_each": len(per_step["with"]),
        "poller_requests": int(out.strip() or 0),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout} s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=100_000)
    ap.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[1, 4],
        help="concurrent connections of the load generator; the first is the target's",
    )
    ap.add_argument("--seconds", type=float, default=8.0, help="load time per endpoint")
    ap.add_argument(
        "--poll",
        choices=["pages", "summary"],
        default="pages",
        help="what the poller asks: ten pages' worth, or only ten live summaries a second",
    )
    ap.add_argument("--steps", type=int, default=82, help="steps of the real job (ABBA: steps 1, 2, 5, 6, ... polled)")
    ap.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = ap.parse_args()
    shape = None
    if args.smoke:  # steps 2 (polled) and 3 (not) after the 2 warm-up steps; a smaller job
        args.trajectories, args.clients, args.seconds, args.steps = 200, [1], 0.2, 4
        shape = ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16"]
    t0 = time.time()
    print(f"API latency, {args.trajectories} trajectories, {args.clients} clients x {args.seconds:.0f} s per endpoint")
    api = api_latency(args.trajectories, args.clients, args.seconds)
    print(f"rollout throughput without / with a polling dashboard (one job, {args.steps} steps, ABBA)")
    job = rollout_overhead(args.steps, args.poll, shape)
    e = api["endpoints"]
    figures = {
        **({"smoke": True} if args.smoke else {}),
        "trajectories": args.trajectories,
        "target_clients": args.clients[0],
        "fill_s": round(api["fill_s"], 1),
        **{f"{name}_p{q}_ms": round(v[f"p{q}_ms"], 2) for name, v in e.items() for q in (50, 99)},
        **{f"{name}_req_per_s": round(v["per_s"], 1) for name, v in e.items()},
        "summary_and_list_p99_under_50ms": all(
            e[f"{k}_c{args.clients[0]}"]["p99_ms"] < 50 for k in ("summary", "list_first_page", "list_deep_page")
        ),
        "rollout_tokens_per_s_without": round(job["without_tokens_per_s"], 1),
        "rollout_tokens_per_s_with_polling": round(job["with_tokens_per_s"], 1),
        "rollout_with_over_without_ratio": None if job["ratio"] is None else round(job["ratio"], 4),
        "rollout_within_5pct": None if job["ratio"] is None else abs(job["ratio"] - 1) <= 0.05,
        "poller_requests": job["poller_requests"],
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
