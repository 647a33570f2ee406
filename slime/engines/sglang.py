"""SGLang rollout engine: launches (or attaches to) an SGLang server and drives its native HTTP API.

The adapter honours the engine contract of `slime.engines` (the built-in `RolloutEngine` is the
reference) over SGLang's native endpoints:

- every request is one streaming ``POST /generate`` (``input_ids``, ``return_logprob``, ``rid``)
  run on a private asyncio loop thread; `step()` returns the tokens received since the previous
  call, one chunk per request, with the ``weight_version`` the server reported for them;
- `abort(ids | None)` sends ``/abort_request`` per ``rid`` (never ``abort_all``: a server may be
  shared) and waits for each stream's last event, so the partial comes back with finish reason
  ``abort``;
- resume: a request with ``response_ids`` is sent as ``input_ids = prompt + response`` with
  ``max_new_tokens`` reduced by what it already has (SGLang has no notion of a response prefix);
- `update_weights`: ``/pause_generation`` (``in_place``: running requests keep their KV cache)
  -> ``/update_weights_from_tensor``, ``/update_weights_from_disk`` or (``distributed``)
  ``/init_weights_update_group`` once, then ``/update_weights_from_distributed`` per bucket while
  this process broadcasts each tensor as rank 0 (NCCL for CUDA tensors, gloo for CPU)
  -> ``/continue_generation``;
  CUDA tensors travel as CUDA IPC handles in SGLang's own pickle format; CPU tensors (the
  built-in engine's SGLang-protocol server) as a `slime.weights` shared-memory handle;
- `score_logprobs` (the weight-sync probe): ``/generate`` with ``max_new_tokens=0`` and
  ``logprob_start_len``, read from ``meta_info.input_token_logprobs``;
- `health()`: ``GET /health_generate`` (and whether the launched process is alive).

Stop tokens are passed explicitly (``stop_token_ids``, ``ignore_eos=true``) so the server never
stops on anything the worker did not ask for. `set_temperature` is not available (SGLang cannot
change a running request's sampling parameters) and returns False.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from slime.engine import GenerationChunk, GenerationRequest

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class _Request:
    request_id: str
    input_ids: list[int]
    payload: dict
    seen: int = 0  # completion tokens already turned into chunks
    finished: bool = False
    abort_requested: bool = False
    task: asyncio.Future | None = None


@dataclass
class _Outbox:
    """Chunks received from the server and not yet returned by step(), merged per request."""

    chunks: dict[str, GenerationChunk] = field(default_factory=dict)

    def add(self, c: GenerationChunk) -> None:
        m = self.chunks.get(c.request_id)
        if m is None:
            self.chunks[c.request_id] = c
        else:
            m.token_ids += c.token_ids
            m.logprobs += c.logprobs
            m.version, m.finished, m.finish_reason = c.version, c.finished, c.finish_reason

    def take(self, ids: set[str] | None = None) -> list[GenerationChunk]:
        if ids is None:
            out, self.chunks = list(self.chunks.values()), {}
            return out
        return [self.chunks.pop(i) for i in list(self.chunks) if i in ids]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_ip_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (a killed Ray actor leaves no orphan)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SglangServerProcess:
    """One launched server: the command, its log file, readiness and shutdown."""

    def __init__(self, command: list[str], url: str, log_path: Path, startup_timeout_s: float):
        self.command, self.url, self.log_path = command, url, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} while starting: {self.describe()}")
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"SGLang server not healthy after {timeout_s:.0f}s (sglang.startup_timeout_s): {self.describe()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

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


def launch_command(launcher: str, model_dir: str, host: str, port: int, *, tensor_parallel_size: int = 1,
                   device: str = "cpu", dtype: str = "float32", max_running_requests: int = 64, seed: int = 0,
                   torch_threads: int | None = None, extra_args: Iterable[str] = ()) -> list[str]:
    if launcher == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host,
               "--port", str(port), "--tp-size", str(tensor_parallel_size), "--dtype", dtype,
               "--max-running-requests", str(max_running_requests), "--random-seed", str(seed)]
    elif launcher == "slime":
        if tensor_parallel_size != 1:
            raise ValueError("sglang.launcher=slime (the built-in engine) supports sglang.tensor_parallel_size=1 only")
        cmd = [sys.executable, "-m", "slime.engines.sglang_server", "--model", model_dir, "--host", host,
               "--port", str(port), "--device", device, "--dtype", dtype,
               "--max-running-requests", str(max_running_requests), "--seed", str(seed)]
        if torch_threads:
            cmd += ["--torch-threads", str(torch_threads)]
    else:
        raise ValueError(f"sglang.launcher={launcher!r}: expected sglang or slime")
    return cmd + list(extra_args)


class SglangEngine:
    def __init__(
        self,
        url: str,
        *,
        version: int = 0,
        weight_update: str = "tensor",
        weights_dir: str | Path | None = None,
        request_timeout_s: float = 600.0,
        server: SglangServerProcess | None = None,
        bucket_mb: float = 256.0,
    ):
        if weight_update not in ("tensor", "disk", "distributed"):
            raise ValueError(f"sglang.weight_update={weight_update!r}: expected tensor, disk or distributed")
        if weight_update == "disk" and weights_dir is None:
            raise ValueError("sglang.weight_update=disk needs a weights directory")
        self.url = url.rstrip("/")
        self.server = server
        self.weight_update = weight_update
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._version = int(version)
        self._http = httpx.Client(base_url=self.url, timeout=request_timeout_s)
        self._timeout = request_timeout_s
        self._requests: dict[str, _Request] = {}
        self._outbox = _Outbox()
        self._cond = threading.Condition()  # guards _requests and _outbox
        self._shm = None  # SharedMemoryTransport: CPU tensors for /update_weights_from_tensor
        self._group = None  # weight_update=distributed: this process is rank 0, the server rank 1
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._tokens_generated = 0
        self._healthy, self._health_at = True, 0.0
        self._error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._loop_thread.start()
        self._aclient: httpx.AsyncClient = self._on_loop(self._make_async_client())
        self._closed = False

    @classmethod
    def from_config(cls, cfg, model_dir: str, index: int, version: int) -> "SglangEngine":
        sg = cfg.sglang
        server = None
        url = sg.url
        if url is None:
            port = sg.port + index if sg.port is not None else free_port(sg.host)
            url = f"http://{sg.host}:{port}"
            cmd = launch_command(
                sg.launcher, model_dir, sg.host, port, tensor_parallel_size=sg.tensor_parallel_size,
                device=cfg.rollout.device, dtype=cfg.model.dtype, max_running_requests=cfg.rollout.max_running_requests,
                seed=cfg.seed + 1000 * index, torch_threads=cfg.cluster.torch_threads, extra_args=sg.extra_args,
            )
            server = SglangServerProcess(cmd, url, cfg.run_dir / "sglang" / f"server_{index}.log", sg.startup_timeout_s)
        return cls(url, version=version, weight_update=sg.weight_update, weights_dir=cfg.run_dir / "sglang" / f"weights_{index}",
                   request_timeout_s=sg.request_timeout_s, server=server, bucket_mb=cfg.weights.bucket_mb)

    # ---- the private event loop -----------------------------------------------------------------
    async def _make_async_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self._timeout), limits=limits)

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _generate(self, r: _Request) -> None:
        try:
            if r.abort_requested:
                raise asyncio.CancelledError
            async with self._aclient.stream("POST", "/generate", json=r.payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"SGLang /generate answered {resp.status_code}: {body[:500]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._on_event(r, json.loads(data))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # surfaced by the next step()
            self._error = f"request {r.request_id!r}: {type(e).__name__}: {e}"
        finally:
            if not r.finished:  # cancelled, failed, or the stream ended without a finish reason
                self._emit(r, [], [], "abort")

    def _on_event(self, r: _Request, out: dict) -> None:
        if "error" in out:
            raise RuntimeError(f"SGLang /generate error: {out['error']}")
        meta = out["meta_info"]
        total = int(meta["completion_tokens"])
        new = total - r.seen
        # Streamed outputs are cumulative by default and incremental with
        # --incremental-streaming-output; the last `new` entries are the new tokens either way.
        ids = out["output_ids"][len(out["output_ids"]) - new:] if new > 0 else []
        lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])[-new:]] if new > 0 else []
        if len(lps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs (return_logprob missing?)")
        r.seen = total
        finish = meta.get("finish_reason")
        reason = None if finish is None else _FINISH.get(finish.get("type"), "abort")
        version = meta.get("weight_version")
        try:
            version = int(version)
        except (TypeError, ValueError):
            version = self._version
        self._emit(r, ids, lps, reason, version)

    def _emit(self, r: _Request, ids: list[int], lps: list[float], reason: str | None, version: int | None = None) -> None:
        with self._cond:
            if r.finished:
                return
            if reason is not None:
                r.finished = True
                self._requests.pop(r.request_id, None)
            self._tokens_generated += len(ids)
            if ids or reason is not None:
                self._outbox.add(GenerationChunk(r.request_id, list(ids), list(lps), self._version if version is None else version,
                                                 reason is not None, reason))
            self._cond.notify_all()

    # ---- the engine contract ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)

    def add_request(self, req: GenerationRequest) -> None:
        p = req.params
        prompt, response = [int(t) for t in req.prompt_ids], [int(t) for t in req.response_ids]
        with self._cond:
            if req.request_id in self._requests:
                raise ValueError(f"request {req.request_id!r} is already running")
        if not prompt and not response:
            raise ValueError(f"request {req.request_id!r}: prompt_ids and response_ids are both empty")
        if p.temperature < 0 or not 0.0 < p.top_p <= 1.0 or p.top_k < 0 or p.max_new_tokens < 0:
            raise ValueError(f"request {req.request_id!r}: invalid sampling params {p}")
        remaining = p.max_new_tokens - len(response)
        r = _Request(req.request_id, prompt + response, {})
        if response and response[-1] in p.stop_token_ids:
            self._emit(r, [], [], "stop")  # resumed after its stop token: nothing left to generate
            return
        if remaining <= 0:
            self._emit(r, [], [], "length")
            return
        r.payload = {
            "rid": req.request_id,
            "input_ids": r.input_ids,
            "sampling_params": {
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k if p.top_k > 0 else -1,
                "max_new_tokens": remaining,
                "stop_token_ids": list(p.stop_token_ids),
                "ignore_eos": True,  # only the caller's stop tokens stop a request
            },
            "return_logprob": True,
            "stream": True,
        }
        with self._cond:
            self._requests[req.request_id] = r
        r.task = asyncio.run_coroutine_threadsafe(self._generate(r), self._loop)

    def step(self) -> list[GenerationChunk]:
        """Chunks received since the last call; waits up to 50 ms for the first one."""
        self._raise_if_failed()
        with self._cond:
            if not self._outbox.chunks and self._requests:
                self._cond.wait(0.05)
            return self._outbox.take()

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationChunk]:
        with self._cond:
            targets = set(self._requests) if request_ids is None else set(request_ids) & set(self._requests)
            for rid in targets:
                self._requests[rid].abort_requested = True
            waiting = {rid: self._requests[rid] for rid in targets}
        if waiting:
            deadline = time.time() + 30
            while True:
                for rid, r in waiting.items():  # by rid, never abort_all: a server may be shared
                    if not r.finished:
                        self._post("/abort_request", {"rid": rid})
                with self._cond:
                    # A rid the server had not registered yet ignores the abort: ask again.
                    self._cond.wait_for(lambda: all(r.finished for r in waiting.values()), timeout=0.5)
                if all(r.finished for r in waiting.values()):
                    break
                if time.time() > deadline:  # closing the stream makes the server abort it
                    for r in waiting.values():
                        if r.task is not None:
                            r.task.cancel()
                    break
        with self._cond:
            if request_ids is None:
                return self._outbox.take()
            return self._outbox.take(set(request_ids))

    def set_temperature(self, request_id: str, temperature: float) -> bool:
        if temperature <= 0:
            raise ValueError(f"set_temperature: temperature must be > 0, got {temperature}")
        return False  # SGLang cannot change a running request's sampling parameters

    def has_unfinished(self) -> bool:
        with self._cond:
            return bool(self._requests or self._outbox.chunks)

    def num_running(self) -> int:
        with self._cond:
            return len(self._requests)

    def num_waiting(self) -> int:
        return 0  # the server queues what it cannot run yet; we cannot see its queue

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Pause the server in place, load the weights, continue. Raises on a refused update (the
        version is then not bumped and the caller must resend)."""
        self._post("/pause_generation", {"mode": "in_place"})
        try:
            if self.weight_update == "distributed":
                self._update_distributed(version, [(n, t.detach().contiguous()) for n, t in named_tensors])
            elif self.weight_update == "disk":
                self._check(self._http.post("/update_weights_from_disk", json=self._write_safetensors(version, named_tensors)),
                            "/update_weights_from_disk")
            else:
                self._check(self._http.post("/update_weights_from_tensor", json=self._tensor_payload(version, named_tensors)),
                            "/update_weights_from_tensor")
        finally:
            self._post("/continue_generation", {})
        self._version = int(version)

    def _update_distributed(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """SGLang's NCCL path (gloo for CPU tensors): one /update_weights_from_distributed per bucket
        of tensors, answered once this process has broadcast each of them from rank 0."""
        from concurrent.futures import ThreadPoolExecutor
        from urllib.parse import urlparse

        from slime.weights import broadcast_from_rank0, join_update_group

        group_name = "slime_weight_update"
        with ThreadPoolExecutor(1) as pool:
            if self._group is None:
                host = urlparse(self.url).hostname or "127.0.0.1"
                addr = "127.0.0.1" if host in ("127.0.0.1", "localhost") else _local_ip_towards(host)
                port = free_port(addr)
                backend = "nccl" if named[0][1].is_cuda else "gloo"
                joined = pool.submit(self._http.post, "/init_weights_update_group", json={
                    "master_address": addr, "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": group_name, "backend": backend})
                self._group = join_update_group(addr, port, 0, 2, group_name, backend, self._timeout)
                self._check(joined.result(), "/init_weights_update_group")
            buckets, size = [[]], 0
            for n, t in named:
                nbytes = t.numel() * t.element_size()
                if buckets[-1] and size + nbytes > self._bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append((n, t))
                size += nbytes
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                answered = pool.submit(self._http.post, "/update_weights_from_distributed", json={
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": group_name, "flush_cache": last,
                    "weight_version": str(version) if last else None})
                for _, t in bucket:
                    broadcast_from_rank0(self._group, t)
                self._check(answered.result(), "/update_weights_from_distributed")

    @staticmethod
    def _check(resp: httpx.Response, path: str) -> None:
        if resp.status_code != 200 or not resp.json().get("success", False):
            raise RuntimeError(f"SGLang {path} failed ({resp.status_code}): {resp.text[:500]}")

    def _tensor_payload(self, version: int, named_tensors) -> dict:
        named = [(n, t.detach()) for n, t in named_tensors]
        if named and named[0][1].is_cuda:
            # SGLang's MultiprocessingSerializer format: torch's pickler turns CUDA tensors into IPC handles.
            from torch.multiprocessing.reductions import ForkingPickler

            buf = io.BytesIO()
            ForkingPickler(buf).dump(named)
            payload, load_format = buf.getvalue(), None
            self._keep_alive = named  # the server maps this memory while it loads
        else:
            from slime.weights import SharedMemoryTransport

            if self._shm is None:
                self._shm = SharedMemoryTransport(f"slime_sglang_{os.getpid()}", bucket_mb=256)
            payload, load_format = pickle.dumps(self._shm.publish(version, named)), "slime_weight_handle"
        return {
            "serialized_named_tensors": [base64.b64encode(payload).decode()],
            "load_format": load_format,
            "flush_cache": True,
            "weight_version": str(version),
        }

    def _write_safetensors(self, version: int, named_tensors) -> dict:
        from safetensors.torch import save_file

        directory = self.weights_dir / f"v{version}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().cpu().contiguous() for n, t in named_tensors}, str(directory / "model.safetensors"))
        for old in self.weights_dir.glob("v*"):
            if old != directory and old.is_dir():
                for f in old.iterdir():
                    f.unlink(missing_ok=True)
                old.rmdir()
        return {"model_path": str(directory), "weight_version": str(version)}

    def score_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        ids = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids),
        }
        resp = self._http.post("/generate", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang /generate (probe) answered {resp.status_code}: {resp.text[:500]}")
        entries = resp.json()["meta_info"]["input_token_logprobs"]
        got = [float(e[0]) for e in entries[len(entries) - len(response_ids):]]
        if len(got) != len(response_ids):
            raise RuntimeError(f"SGLang returned {len(got)} input logprobs for {len(response_ids)} probe tokens")
        return got

    def health(self) -> dict:
        """SGLang's /health_generate runs a generation (and waits ~1 s) when the server is idle:
        asked at most every 10 s, the answer in between is the last one."""
        if time.time() - self._health_at > 10:
            try:
                self._healthy = self._http.get("/health_generate", timeout=30).status_code == 200
            except httpx.HTTPError:
                self._healthy = False
            self._health_at = time.time()
        healthy = self._healthy and (self.server is None or self.server.alive())
        with self._cond:
            running = len(self._requests)
        return {
            "healthy": healthy,
            "url": self.url,
            "running": running,
            "waiting": 0,
            "version": self._version,
            "tokens_generated": self._tokens_generated,
            "device": "sglang",
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.abort(None)
        except Exception:
            pass
        try:
            self._on_loop(self._aclient.aclose())
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        self._http.close()
        if self._shm is not None:
            self._shm.close()
        if self.server is not None:
            self.server.stop()

    # ---- helpers --------------------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> httpx.Response:
        resp = self._http.post(path, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp

    def _raise_if_failed(self) -> None:
        if self.server is not None and not self.server.alive():
            raise RuntimeError(f"the SGLang server exited with code {self.server.proc.returncode}: {self.server.describe()}")
        if self._error is not None:
            raise RuntimeError(f"SGLang generation failed: {self._error}")
