"""The HTTP reward service: `slime reward-serve SPEC [--host H] [--port N] [--token-file PATH]`.

    POST /score   {"samples": [{"prompt", "response", "label", "metadata"}, ...]}
               -> {"results": [{"reward", "failure"?, "latency_s", "step_scores"?, "step_ends"?, "info"?}, ...]}
    GET  /health  -> {"status": "ok", "reward", "scored", "failed", "hung_calls", "pending", "max_pending"}

One result per sample, in order. Each sample runs through a RewardRunner (timeout and concurrency
per call), so a reward that raises, hangs or returns garbage fails only its own sample, with the
reason in "failure"; the request itself succeeds. SPEC is anything `reward.fn` accepts: a plugin
spec string, or a YAML/JSON file holding a spec (string or mix/route/kwargs dict).

Security (docs/security.md): whoever reaches /score runs the reward (with `envs.code_reward`, code
in the sandbox), so /score always needs the server's token (`Authorization: Bearer`), and on a
non-loopback bind every route does; such a bind without a token refuses to start. The token comes
from the environment (`SLIME_API_TOKEN`) or `--token-file`; on loopback without either, one is
generated and written to a 0600 file whose path (never the token) is printed. Bodies are capped
(`--max-body-mb`) and at most `--max-pending` samples wait across requests (429 beyond). Names in
/health and in failures are the spec with its secrets redacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from rewards.mix import describe_spec, load_reward_spec
from rewards.runner import RewardRunner
from rewards.service import result_to_wire
from slime.security import API_TOKEN_ENV, GuardPolicy, HttpGuard, check_bind, new_secret, read_token, write_private

MAX_BATCH = 4096  # samples in one request
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_PENDING = 4096


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    response: str
    label: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[ScoreItem] = Field(max_length=MAX_BATCH)


class ScoreResult(BaseModel):
    reward: float | None
    failure: str | None
    latency_s: float
    step_scores: list[float] | None = None
    step_ends: list[int] | None = None
    info: dict[str, Any] | None = None


class ScoreResponse(BaseModel):
    results: list[ScoreResult]


class Health(BaseModel):
    status: str
    reward: str = Field(description="The served spec, secrets redacted.")
    scored: int
    failed: int
    hung_calls: int
    pending: int = Field(description="Samples accepted and not scored yet, across requests.")
    max_pending: int


class Backlog:
    """Samples accepted and not scored yet, across requests. Each leaves when its own future
    resolves, so a client that hangs up does not free room while its samples still run."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_pending must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0
        self._lock = threading.Lock()

    def admit(self, n: int) -> bool:
        with self._lock:
            if self.count + n > self.limit:
                return False
            self.count += n
            return True

    def release(self, n: int = 1) -> None:
        with self._lock:
            self.count -= n


def make_app(
    runner: RewardRunner,
    *,
    token: str | None = None,
    bind_host: str = "127.0.0.1",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_pending: int = DEFAULT_MAX_PENDING,
) -> FastAPI:
    """The reward server's app. /score always needs ``token`` (without one it answers 403)."""
    backlog = Backlog(max_pending)
    app = FastAPI(title="slime reward service")
    app.add_middleware(HttpGuard, policy=GuardPolicy(token=token, bind_host=bind_host, max_body_bytes=max_body_bytes))
    counts = {"scored": 0, "failed": 0}

    @app.post("/score", response_model=ScoreResponse, response_model_exclude_none=True)
    async def score(request: ScoreRequest) -> ScoreResponse:
        n = len(request.samples)
        if n > backlog.limit:
            raise HTTPException(
                413,
                f"samples: {n} in one request, more than this server queues "
                f"(--max-pending {backlog.limit}); send smaller batches",
            )
        if not backlog.admit(n):
            raise HTTPException(
                429,
                f"{backlog.count} samples are waiting (at most {backlog.limit}); retry later",
                headers={"Retry-After": "1"},
            )
        futures = []
        try:
            for s in request.samples:
                futures.append(runner.submit(s.prompt, s.response, s.label, s.metadata))
                futures[-1].add_done_callback(lambda _: backlog.release())
        finally:
            backlog.release(n - len(futures))  # those never submitted (the runner closed under us)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        counts["scored"] += len(results)
        counts["failed"] += sum(1 for r in results if not r.ok)
        return ScoreResponse(results=[ScoreResult(**result_to_wire(r)) for r in results])

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(
            status="ok",
            reward=runner.name,
            hung_calls=runner.hung_calls,
            pending=backlog.count,
            max_pending=backlog.limit,
            **counts,
        )

    return app


class ServerThread:
    """A uvicorn server for `app` on a thread, on a free port unless one is given (tests, benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_spec(spec: str) -> str | dict:
    """A plugin spec string as is; a .yaml/.yml/.json file's content (a spec string or dict)."""
    path = Path(spec)
    if ":" not in spec and path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"reward spec file not found: {path.resolve()}")
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        if isinstance(data, dict) and "reward" in data and isinstance(data["reward"], dict) and "fn" in data["reward"]:
            data = data["reward"]["fn"]  # a job config: serve its reward
        if not isinstance(data, (str, dict)):
            raise ValueError(f"{path}: expected a reward spec (string or dict), got {type(data).__name__}")
        return data
    return spec


def default_token_file(port: int) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "slime-april" / f"reward-serve-{port}.token"


def server_token(host: str, port: int, token_file: str | None) -> tuple[str, Path | None]:
    """The token to serve with, and the file it was written to when generated here.

    The environment (SLIME_API_TOKEN) wins, then an existing --token-file (default:
    `default_token_file(port)`, so a restarted server keeps the token its clients have). On
    loopback, without either, a fresh token goes to that file, 0600. A non-loopback host needs a
    token given (ValueError)."""
    token = read_token(None)
    path = Path(token_file) if token_file is not None else default_token_file(port)
    if token is None and path.exists():
        token = read_token(str(path))
    if token is not None:
        return token, None
    check_bind(host, None, "slime reward-serve")  # raises: others could reach it without a token
    token = new_secret()
    write_private(path, token + "\n")
    return token, path


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (OSError naming the address when it is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def main_reward_serve(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slime reward-serve",
        description="Serve a reward over HTTP (POST /score, GET /health); jobs use it with reward.mode=http, "
        "reward.url=..., reward.token=... (docs/rewards.md)",
    )
    parser.add_argument(
        "spec", help="pkg.module:fn, path/to/file.py:fn, or a YAML/JSON file with a spec (or a job config)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others need a token)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"read the token from this file; on loopback, when it does not exist and "
        f"{API_TOKEN_ENV} is unset, a new token is written there (0600). Default: "
        f"~/.cache/slime-april/reward-serve-PORT.token",
    )
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-sample timeout (default 30)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="samples scored at once (default 8)")
    parser.add_argument(
        "--max-pending",
        type=int,
        default=DEFAULT_MAX_PENDING,
        help=f"samples waiting across requests before 429 (default {DEFAULT_MAX_PENDING})",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
        help="largest request body in MiB (default 4); bigger ones get 413",
    )
    ns = parser.parse_args(args)

    try:
        if ns.max_body_mb <= 0 or ns.max_pending < 1:
            raise ValueError("--max-body-mb must be > 0 and --max-pending >= 1")
        # Bound first: a second server on a port in use must not replace the first one's token file.
        listener = _listen(ns.host, ns.port)
        token, written = server_token(ns.host, ns.port, ns.token_file)
        spec = read_spec(ns.spec)
        runner = RewardRunner(load_reward_spec(spec), ns.timeout_s, ns.max_concurrency, name=describe_spec(spec))
    except (ValueError, TypeError, OSError) as exc:  # PluginError and RewardSpecError are ValueErrors
        print(f"slime reward-serve: {exc}", file=sys.stderr)
        return 2
    if written is not None:
        print(
            f"slime reward-serve: generated a token in {written} (0600); clients send it as "
            f"'Authorization: Bearer <token>' (reward.token)",
            flush=True,
        )
    shown = f"[{ns.host}]" if ":" in ns.host else ns.host
    print(f"slime reward-serve: {runner.name} on http://{shown}:{ns.port} (POST /score, GET /health)", flush=True)
    app = make_app(
        runner,
        token=token,
        bind_host=ns.host,
        max_body_bytes=int(ns.max_body_mb * (1 << 20)),
        max_pending=ns.max_pending,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    runner.close()
    return 0
