"""The HTTP reward service: `slime reward-serve SPEC [--host H] [--port N]`.

    POST /score   {"samples": [{"prompt", "response", "label", "metadata"}, ...]}
               -> {"results": [{"reward", "failure", "latency_s", "step_scores"?, "step_ends"?, "info"?}, ...]}
    GET  /health  -> {"status": "ok", "reward", "scored", "failed", "hung_calls"}

One result per sample, in order. Each sample runs through a RewardRunner (timeout and concurrency
per call), so a reward that raises, hangs or returns garbage fails only its own sample, with the
reason in "failure"; the request itself succeeds. SPEC is anything `reward.fn` accepts: a plugin
spec string, or a YAML/JSON file holding a spec (string or mix/route/kwargs dict).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from rewards.runner import RewardRunner
from rewards.service import result_to_wire


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    response: str
    label: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[ScoreItem] = Field(max_length=4096)


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
    reward: str
    scored: int
    failed: int
    hung_calls: int


def make_app(runner: RewardRunner) -> FastAPI:
    app = FastAPI(title="slime reward service")
    counts = {"scored": 0, "failed": 0}

    @app.post("/score", response_model=ScoreResponse, response_model_exclude_none=True)
    async def score(request: ScoreRequest) -> ScoreResponse:
        futures = [runner.submit(s.prompt, s.response, s.label, s.metadata) for s in request.samples]
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        counts["scored"] += len(results)
        counts["failed"] += sum(1 for r in results if not r.ok)
        return ScoreResponse(results=[ScoreResult(**result_to_wire(r)) for r in results])

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(status="ok", reward=runner.name, hung_calls=runner.hung_calls, **counts)

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


def main_reward_serve(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slime reward-serve",
        description="Serve a reward over HTTP (POST /score, GET /health); jobs use it with reward.mode=http, reward.url=...",
    )
    parser.add_argument("spec", help="pkg.module:fn, path/to/file.py:fn, or a YAML/JSON file with a spec (or a job config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-sample timeout (default 30)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="samples scored at once (default 8)")
    ns = parser.parse_args(args)
    from rewards.mix import load_reward_spec

    try:
        spec = read_spec(ns.spec)
        runner = RewardRunner(load_reward_spec(spec), ns.timeout_s, ns.max_concurrency, name=str(spec))
    except (ValueError, TypeError, OSError) as exc:  # PluginError and RewardSpecError are ValueErrors
        print(f"slime reward-serve: {exc}", file=sys.stderr)
        return 2
    print(f"slime reward-serve: {runner.name} on http://{ns.host}:{ns.port} (POST /score, GET /health)", flush=True)
    uvicorn.run(make_app(runner), host=ns.host, port=ns.port, log_level="warning")
    runner.close()
    return 0
