"""The SGLang engine's processes: launched servers (SGLang's or the built-in engine's
SGLang-protocol server) and sglang-router, their commands, readiness and shutdown, and what one
rollout worker attaches to or launches (`launch_worker_servers`).

Launched processes get the job's token in their environment (`slime.security.API_TOKEN_ENV`),
never argv: our server reads it there; SGLang's server and sglang-router are started through
`slime.engines.sglang.launch`, which turns it into ``--api-key`` inside the process. Each child
gets SIGTERM when its parent dies, so a killed Ray actor leaves no orphan.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from slime.config import JobConfig
from slime.security import API_TOKEN_ENV, auth_headers, is_loopback


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_ip_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def update_group_address(server_host: str) -> str:
    """The address this process announces as master of a weight-update group to servers on
    ``server_host`` (launched servers accept only that one)."""
    return "127.0.0.1" if is_loopback(server_host) else _local_ip_towards(server_host)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (a killed Ray actor leaves no orphan)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SglangServerProcess:
    """One launched server (or, subclassed, the router): the command, its log file, readiness and shutdown.

    ``startup_timeout_s=None`` returns at once (several processes start together, then
    `wait_ready` each)."""

    def __init__(
        self,
        command: list[str],
        url: str,
        log_path: Path,
        startup_timeout_s: float | None,
        *,
        name: str = "SGLang server",
        token: str | None = None,
    ):
        self.command, self.url, self.log_path, self.name = command, url, log_path, name
        self.headers = auth_headers(token)
        env = dict(os.environ)
        env.pop(API_TOKEN_ENV, None)
        if token is not None:
            env[API_TOKEN_ENV] = token  # the environment, not argv: ps shows argv to every user
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env,
        )
        if startup_timeout_s is not None:
            self.wait_ready(startup_timeout_s)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health_generate", headers=self.headers, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} while starting: {self.describe()}"
                )
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"{self.name} not ready after {timeout_s:.0f}s (sglang.startup_timeout_s): {self.describe()}"
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_message(self) -> str:
        return f"{self.name} at {self.url} (pid {self.proc.pid}) exited with code {self.proc.returncode}; {self.describe()}"

    def describe(self) -> str:
        try:
            tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            tail = ""
        return f"command {' '.join(self.command)!r}, log {self.log_path}:\n{tail}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()


class SglangRouterProcess(SglangServerProcess):
    """A launched sglang-router: ready once it lists every one of its servers as healthy."""

    def __init__(
        self,
        command: list[str],
        url: str,
        log_path: Path,
        startup_timeout_s: float,
        worker_urls: list[str],
        *,
        name: str = "sglang-router",
        token: str,
    ):
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        super().__init__(command, url, log_path, startup_timeout_s, name=name, token=token)

    def ready(self) -> bool:
        try:
            workers = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=10).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False
        healthy = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
        return set(self.worker_urls) <= healthy


def router_command(
    worker_urls: list[str], host: str, port: int, *, policy: str, prometheus_port: int, request_timeout_s: float
) -> list[str]:
    """sglang-router 0.3.2's flags (sglang_router/router_args.py), run through `slime.engines.sglang.launch`
    (it adds ``--api-key`` from the environment: the router then requires the key from clients and
    sends it to the servers). Its metrics endpoint defaults to 0.0.0.0:29000, which a second router
    on the machine could not bind: each gets a port of its own."""
    return [
        sys.executable,
        "-m",
        "slime.engines.sglang.launch",
        "router",
        "--worker-urls",
        *worker_urls,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--request-timeout-secs",
        str(int(request_timeout_s)),
        "--log-level",
        "warn",
    ]


def launch_router(
    worker_urls: list[str],
    host: str,
    port: int | None,
    policy: str,
    log_path: Path,
    startup_timeout_s: float,
    request_timeout_s: float,
    *,
    token: str,
    name: str = "sglang-router",
) -> SglangRouterProcess:
    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError(
            "sglang.router=sglang_router needs the sglang-router package where the rollout worker runs: "
            "pip install sglang-router (it is in this project's sglang and dev extras)"
        )
    port = port if port is not None else free_port(host)
    cmd = router_command(
        worker_urls, host, port, policy=policy, prometheus_port=free_port(host), request_timeout_s=request_timeout_s
    )
    return SglangRouterProcess(
        cmd, f"http://{host}:{port}", log_path, startup_timeout_s, worker_urls, name=name, token=token
    )


def launch_command(
    launcher: str,
    model_dir: str,
    host: str,
    port: int,
    *,
    tensor_parallel_size: int = 1,
    base_gpu_id: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    max_running_requests: int = 64,
    seed: int = 0,
    torch_threads: int | None = None,
    weights_dir: str | Path | None = None,
    update_group_hosts: Iterable[str] = (),
    extra_args: Iterable[str] = (),
) -> list[str]:
    """The command of one server; its token travels in the environment (`SglangServerProcess`).
    ``weights_dir`` / ``update_group_hosts``: what our server accepts in disk updates and as an
    update group's master (SGLang's server has no such limits)."""
    if launcher == "sglang":
        cmd = [
            sys.executable,
            "-m",
            "slime.engines.sglang.launch",
            "sglang",
            "--model-path",
            model_dir,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(tensor_parallel_size),
            "--base-gpu-id",  # a worker's servers side by side on its GPUs, not all on the first
            str(base_gpu_id),
            "--dtype",
            dtype,
            "--max-running-requests",
            str(max_running_requests),
            "--random-seed",
            str(seed),
        ]
    elif launcher == "slime":
        if tensor_parallel_size != 1:
            raise ValueError("sglang.launcher=slime (the built-in engine) supports sglang.tensor_parallel_size=1 only")
        cmd = [
            sys.executable,
            "-m",
            "slime.engines.sglang.server",
            "--model",
            model_dir,
            "--host",
            host,
            "--port",
            str(port),
            "--device",
            device,
            "--dtype",
            dtype,
            "--max-running-requests",
            str(max_running_requests),
            "--seed",
            str(seed),
        ]
        if torch_threads:
            cmd += ["--torch-threads", str(torch_threads)]
        if weights_dir is not None:
            cmd += ["--weights-dir", str(weights_dir)]
        hosts = list(update_group_hosts)
        if hosts:
            cmd += ["--update-group-hosts", ",".join(hosts)]
    else:
        raise ValueError(f"sglang.launcher={launcher!r}: expected sglang or slime")
    return cmd + list(extra_args)


def launch_worker_servers(
    cfg: JobConfig, model_dir: str, index: int, weights_dir: Path, token: str | None
) -> tuple[str, list[str], list[SglangServerProcess]]:
    """Rollout worker ``index``'s servers: ``sglang.url``/``urls`` attached to, or
    ``sglang.num_servers`` launched (logs under the run directory, disk updates only from
    ``weights_dir``), then (``sglang.router=sglang_router``) a router launched in front of them.
    Returns (the URL that takes every ``/generate``, the servers' URLs, the launched processes);
    on a failure, what was launched is stopped."""
    sg = cfg.sglang
    run_dir = cfg.run_dir / "sglang"
    processes: list[SglangServerProcess] = []
    try:
        server_urls = [sg.url] if sg.url is not None else list(sg.urls)
        if not server_urls:
            weights_dir.mkdir(parents=True, exist_ok=True)
            for j in range(sg.num_servers):
                port = sg.port + index * sg.num_servers + j if sg.port is not None else free_port(sg.host)
                cmd = launch_command(
                    sg.launcher,
                    model_dir,
                    sg.host,
                    port,
                    tensor_parallel_size=sg.tensor_parallel_size,
                    base_gpu_id=j * sg.tensor_parallel_size,
                    device=cfg.rollout.device,
                    dtype=cfg.model.dtype,
                    max_running_requests=cfg.rollout.max_running_requests,
                    seed=cfg.seed + 1000 * index + j,
                    torch_threads=cfg.cluster.torch_threads,
                    weights_dir=weights_dir,
                    update_group_hosts=[update_group_address(sg.host)],
                    # SGLang releases memory (rollout.release_memory) only when started with its saver.
                    extra_args=[*sg.extra_args]
                    + (["--enable-memory-saver"] if sg.launcher == "sglang" and cfg.releases_engine_memory else []),
                )
                log = run_dir / (f"server_{index}.log" if sg.num_servers == 1 else f"server_{index}_{j}.log")
                processes.append(
                    SglangServerProcess(
                        cmd,
                        f"http://{sg.host}:{port}",
                        log,
                        None,
                        name=f"SGLang server {j} of rollout worker {index}",
                        token=token,
                    )
                )
            deadline = time.time() + sg.startup_timeout_s  # started together, one deadline for all
            for proc in processes:
                proc.wait_ready(max(deadline - time.time(), 1.0))
            server_urls = [proc.url for proc in processes]
        url = server_urls[0]
        if sg.router == "sglang_router":
            router = launch_router(
                server_urls,
                sg.host,
                sg.router_port + index if sg.router_port is not None else None,
                sg.router_policy,
                run_dir / f"router_{index}.log",
                sg.startup_timeout_s,
                sg.request_timeout_s,
                token=token,
                name=f"sglang-router of rollout worker {index}",
            )
            processes.append(router)
            url = router.url
    except BaseException:
        for proc in reversed(processes):
            proc.stop()
        raise
    return url, server_urls, processes
