"""SGLang rollout engine: launches (or attaches to) SGLang servers and drives their native HTTP API.

The adapter honours the engine contract (`slime.engines.contract.RolloutEngine`; the built-in
engine is the reference) over SGLang's native endpoints:

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
  to the built-in engine's SGLang-protocol server (its ``/server_info`` says engine
  ``slime-builtin``) tensors travel as the JSON form of a `slime.weights` handle (shared memory
  for CPU tensors, CUDA IPC for CUDA tensors), never a pickle; to a real SGLang server in
  SGLang's own pickled format (CUDA IPC handles), which it accepts only with the job's key;
- `score_logprobs` (the weight-sync probe): ``/generate`` with ``max_new_tokens=0`` and
  ``logprob_start_len``, read from ``meta_info.input_token_logprobs``;
- `health()`: ``GET /health_generate`` (and whether the launched processes are alive).

Several servers per worker (``sglang.num_servers`` or ``sglang.urls``) sit behind sglang-router
(``sglang.router=sglang_router``): the data path, every ``/generate`` stream, goes through the
router, which balances them; the control path goes to every server directly, because the router
does not forward it: ``/abort_request`` (each rid to every server: which one holds it is the
router's choice), ``/pause_generation``, ``/continue_generation``, the weight updates (for
``distributed`` every server joins the group, server j as rank ``1 + j * tp``), the probe (asked
of every server, so a server that missed an update is caught) and ``/health_generate``.

Stop tokens are passed explicitly (``stop_token_ids``, ``ignore_eos=true``) so the server never
stops on anything the worker did not ask for. `set_temperature` is not available (SGLang cannot
change a running request's sampling parameters) and returns False.

Auth: every request carries ``Authorization: Bearer <api_token>``; launched servers and the
router get the token in their environment, never argv (`slime.engines.sglang.processes`, which
launches them). Launched servers of ours load disk updates only from the worker's weights
directory and join update groups only at the address this process announces.

Longer than 500 lines: one class over one HTTP protocol (SGLang's), method by method of the engine
contract; its launched processes, the protocol server and its engine thread are files of their own.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler  # with torch's reductions (import torch registers them)
from pathlib import Path
from urllib.parse import urlparse

import httpx
import torch
from safetensors.torch import save_file

from slime.config import JobConfig
from slime.engines.contract import (
    GenerationChunk,
    GenerationRequest,
    StopStrings,
    checked_token_ids,
    validate_sampling,
)
from slime.engines.sglang.processes import SglangServerProcess, free_port, launch_worker_servers, update_group_address
from slime.model import load_tokenizer
from slime.security import auth_headers, new_secret, printable_excerpt, read_token
from slime.weights import CudaIpcTransport, SharedMemoryTransport, broadcast_from_rank0, join_update_group

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
    stops: StopStrings | None = None  # stop_strings, matched here (the server runs token ids only)
    response: list[int] = field(default_factory=list)  # with stop strings: this model turn's tokens so far
    stopped: tuple[list[int], list[float], int] | None = None  # the tokens up to a stop string, to emit


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


class SglangEngine:
    """``url`` takes every ``/generate`` (a router, or the only server); ``server_urls`` (default:
    ``[url]``) take the control calls; ``processes`` are the launched servers and router, watched by
    `health()` / `step()` and stopped by `close()`."""

    def __init__(
        self,
        url: str,
        *,
        server_urls: list[str] | None = None,
        processes: Iterable[SglangServerProcess] = (),
        version: int = 0,
        weight_update: str = "tensor",
        weights_dir: str | Path | None = None,
        request_timeout_s: float = 600.0,
        bucket_mb: float = 256.0,
        tensor_parallel_size: int = 1,
        probe_tolerance: float = 1e-3,
        api_token: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        if weight_update not in ("tensor", "disk", "distributed"):
            raise ValueError(f"sglang.weight_update={weight_update!r}: expected tensor, disk or distributed")
        if weight_update == "disk" and weights_dir is None:
            raise ValueError("sglang.weight_update=disk needs a weights directory")
        self.url = url.rstrip("/")
        self.server_urls = [u.rstrip("/") for u in (server_urls or [url])]
        self.processes = list(processes)
        self.weight_update = weight_update
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.tensor_parallel_size = tensor_parallel_size
        self.probe_tolerance = probe_tolerance
        self._decode = decode  # the tokenizer's: what matches stop_strings
        self._version = int(version)
        self._timeout = request_timeout_s
        self._requests: dict[str, _Request] = {}
        self._outbox = _Outbox()
        self._cond = threading.Condition()  # guards _requests and _outbox
        self._headers = auth_headers(api_token)
        self._builtin: dict[str, bool] = {}  # server url -> is it the built-in engine's server (JSON handles)
        self._shm: SharedMemoryTransport | None = None  # CPU tensors for /update_weights_from_tensor
        self._cuda_ipc: CudaIpcTransport | None = None  # CUDA tensors for the built-in engine's server
        self._group = None  # weight_update=distributed: this process is rank 0, the servers' ranks follow
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._tokens_generated = 0
        self._endpoint_error: str | None = None  # the last health probe's complaint
        self._health_at = 0.0
        self._error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._loop_thread.start()
        self._aclient: httpx.AsyncClient = self._on_loop(self._make_async_client())
        self._closed = False

    @classmethod
    def from_config(
        cls, cfg: JobConfig, model_dir: str, index: int, version: int, *, api_token: str | None = None
    ) -> SglangEngine:
        """Worker ``index``: attach to ``sglang.url``/``urls`` or launch ``sglang.num_servers``
        servers, then (``sglang.router=sglang_router``) a router in front of them. ``api_token``
        (else the environment's `API_TOKEN_ENV`; launched processes without either get a fresh
        one) is sent on every request and handed to launched processes in their environment."""
        sg = cfg.sglang
        weights_dir = cfg.run_dir / "sglang" / f"weights_{index}"
        token = api_token or read_token()
        launches = (sg.url is None and not sg.urls) or sg.router == "sglang_router"
        if token is None and launches:
            token = new_secret()  # launched processes need one: every control route requires it
        url, server_urls, processes = launch_worker_servers(cfg, model_dir, index, weights_dir, token)
        return cls(
            url,
            server_urls=server_urls,
            processes=processes,
            version=version,
            weight_update=sg.weight_update,
            weights_dir=weights_dir,
            request_timeout_s=sg.request_timeout_s,
            bucket_mb=cfg.weights.bucket_mb,
            tensor_parallel_size=sg.tensor_parallel_size,
            probe_tolerance=cfg.weights.check_tolerance,
            api_token=token,
            decode=load_tokenizer(model_dir).decode if cfg.rollout.stop else None,
        )

    # ---- the private event loop -----------------------------------------------------------------
    async def _make_async_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(self._timeout), limits=limits, headers=self._headers
        )

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _send(self, requests: list[tuple[str, dict]]) -> concurrent.futures.Future:
        """POST every ``(absolute url, body)`` at once on the client loop; the future holds the
        responses in order. A server that cannot be reached raises, naming its URL."""

        async def post(url: str, body: dict, in_flight: asyncio.Semaphore) -> httpx.Response:
            try:
                async with in_flight:
                    return await self._aclient.post(url, json=body)
            except httpx.HTTPError as e:
                raise RuntimeError(f"SGLang POST {url} failed: {type(e).__name__}: {e}") from e

        async def post_all() -> list[httpx.Response]:
            in_flight = asyncio.Semaphore(64)  # aborting many rids on many servers: not all connections at once
            return list(await asyncio.gather(*(post(u, b, in_flight) for u, b in requests)))

        return asyncio.run_coroutine_threadsafe(post_all(), self._loop)

    def _post_all(self, path: str, body: dict, *, expect_success: bool = False) -> list[httpx.Response]:
        """The same control call to every server directly (the router does not forward these)."""
        responses = self._send([(f"{u}{path}", body) for u in self.server_urls]).result()
        for resp in responses:
            self._check(resp, expect_success)
        return responses

    async def _generate(self, r: _Request) -> None:
        try:
            if r.abort_requested:
                raise asyncio.CancelledError
            async with self._aclient.stream("POST", "/generate", json=r.payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"SGLang /generate answered {resp.status_code}: {printable_excerpt(body, 500)}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._on_event(r, json.loads(data))
                    if r.stopped is not None:
                        break
            if r.stopped is not None:
                # A stop string: the server is told to drop the request before the caller hears it
                # stopped, since the caller may send the same request id again at once (the next
                # model turn of an episode). A server that finished it already ignores the abort.
                await asyncio.gather(
                    *(self._aclient.post(f"{u}/abort_request", json={"rid": r.request_id}) for u in self.server_urls),
                    return_exceptions=True,  # a server gone: the next request finds out
                )
                ids, lps, version = r.stopped
                self._emit(r, ids, lps, "stop", version)
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
        ids = out["output_ids"][len(out["output_ids"]) - new :] if new > 0 else []
        lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])[-new:]] if new > 0 else []
        if len(lps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs (return_logprob missing?)")
        r.seen = total
        finish = meta.get("finish_reason")
        reason = None if finish is None else _FINISH.get(finish.get("type"), "abort")
        if r.stops is not None and ids:
            r.response += ids
            keep = r.stops.new_tokens_kept(r.response, len(ids))
            if keep is not None:  # cut after the token that completed it; _generate ends the request
                ids, lps, reason = ids[:keep], lps[:keep], "stop"
        version = meta.get("weight_version")
        try:
            version = int(version)
        except (TypeError, ValueError):
            version = self._version
        if reason == "stop" and finish is None:
            r.stopped = (ids, lps, version)  # a stop string, not the server's: emitted once the server dropped it
            return
        self._emit(r, ids, lps, reason, version)

    def _emit(
        self, r: _Request, ids: list[int], lps: list[float], reason: str | None, version: int | None = None
    ) -> None:
        with self._cond:
            if r.finished:
                return
            if reason is not None:
                r.finished = True
                self._requests.pop(r.request_id, None)
            self._tokens_generated += len(ids)
            if ids or reason is not None:
                self._outbox.add(
                    GenerationChunk(
                        r.request_id,
                        list(ids),
                        list(lps),
                        self._version if version is None else version,
                        reason is not None,
                        reason,
                    )
                )
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
        with self._cond:
            if req.request_id in self._requests:
                raise ValueError(f"request {req.request_id!r} is already running")
        if len(req.prompt_ids) == 0 and len(req.response_ids) == 0:
            raise ValueError(f"request {req.request_id!r}: prompt_ids and response_ids are both empty")
        try:  # the server checks the vocabulary and context bounds, which only it knows
            validate_sampling(p, vocab_size=None, max_seq_len=None)
            prompt = checked_token_ids(req.prompt_ids, vocab_size=None, field_name="prompt_ids")
            response = checked_token_ids(req.response_ids, vocab_size=None, field_name="response_ids")
            own = response[req.checked_turn_start() :]  # this model turn's tokens (stops read only these)
            if p.stop_strings and self._decode is None:
                raise ValueError("stop_strings need the tokenizer's decode (SglangEngine(decode=...))")
        except ValueError as e:
            raise ValueError(f"request {req.request_id!r}: {e}") from None
        remaining = p.max_new_tokens - len(response)
        r = _Request(req.request_id, prompt + response, {})
        if p.stop_strings:
            r.stops, r.response = StopStrings(p.stop_strings, self._decode), list(own)
        if own and (own[-1] in p.stop_token_ids or r.stops is not None and r.stops.ends(own)):
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
                **({} if p.seed is None else {"sampling_seed": p.seed}),
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
                # By rid, never abort_all: a server may be shared. Each rid goes to every server:
                # sglang-router 0.3.2 does not forward /abort_request (it answers 404) and only it
                # knows which server holds a rid; one that does not hold it ignores the abort
                # (SGLang, and our server: BuiltinEngine.abort skips unknown ids).
                unfinished = [rid for rid, r in waiting.items() if not r.finished]
                for resp in self._send(
                    [(f"{u}/abort_request", {"rid": rid}) for u in self.server_urls for rid in unfinished]
                ).result():
                    self._check(resp)
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

    def forget(self, request_ids: list[str]) -> None:
        """Nothing kept per request here (the servers' radix caches are their own)."""

    def release_memory(self) -> int:
        """SGLang's memory release on every server (``/release_memory_occupation``; a real SGLang
        server needs ``--enable-memory-saver``, which the launch adds with rollout.release_memory).
        Bytes freed when the server says (the SGLang-protocol server over the built-in engine does)."""
        responses = self._post_all("/release_memory_occupation", {})
        self._released = True
        freed = 0
        for resp in responses:
            try:
                freed += int(resp.json().get("freed_bytes", 0))
            except (ValueError, AttributeError):  # SGLang answers without a body
                pass
        return freed

    def resume_memory(self) -> None:
        """Every server takes its memory back (``/resume_memory_occupation``) before generating again."""
        if getattr(self, "_released", False):  # SGLang refuses a resume without a release
            self._post_all("/resume_memory_occupation", {})
            self._released = False

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Pause every server in place, load the weights, continue. Raises on a refused update (the
        version is then not bumped and the caller must resend). Every server is paused first and
        continued last, so none generates with other weights than the rest for long."""
        self._post_all("/pause_generation", {"mode": "in_place"})
        try:
            if self.weight_update == "distributed":
                self._update_distributed(version, [(n, t.detach().contiguous()) for n, t in named_tensors])
            elif self.weight_update == "disk":  # one directory, loaded by every server
                self._post_all(
                    "/update_weights_from_disk", self._write_safetensors(version, named_tensors), expect_success=True
                )
            else:  # one shared-memory (or CUDA IPC) publication, mapped by every server
                self._update_from_tensor(version, named_tensors)
        finally:
            self._post_all("/continue_generation", {})
        self._version = int(version)

    def _update_distributed(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """SGLang's NCCL path (gloo for CPU tensors): one /update_weights_from_distributed per bucket
        of tensors to every server, answered once this process has broadcast each of them from
        rank 0. Server j's tensor-parallel ranks are ``1 + j * tp`` .. ``(j + 1) * tp``."""
        group_name = "slime_weight_update"
        if self._group is None:
            addr = update_group_address(urlparse(self.server_urls[0]).hostname or "127.0.0.1")
            port = free_port(addr)
            backend = "nccl" if named[0][1].is_cuda else "gloo"
            tp = self.tensor_parallel_size
            world_size = 1 + len(self.server_urls) * tp
            joined = self._send(
                [
                    (
                        f"{u}/init_weights_update_group",
                        {
                            "master_address": addr,
                            "master_port": port,
                            "rank_offset": 1 + j * tp,
                            "world_size": world_size,
                            "group_name": group_name,
                            "backend": backend,
                        },
                    )
                    for j, u in enumerate(self.server_urls)
                ]
            )
            self._group = join_update_group(addr, port, 0, world_size, group_name, backend, self._timeout)
            for resp in joined.result():
                self._check(resp, expect_success=True)
        buckets = _buckets(named, self._bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group_name,
                "flush_cache": last,
                "weight_version": str(version) if last else None,
            }
            answered = self._send([(f"{u}/update_weights_from_distributed", body) for u in self.server_urls])
            for _, t in bucket:
                broadcast_from_rank0(self._group, t)
            for resp in answered.result():
                self._check(resp, expect_success=True)

    @staticmethod
    def _check(resp: httpx.Response, expect_success: bool = False) -> None:
        """Raise, naming the server and the endpoint, unless it answered 200 (and ``success``)."""
        ok = resp.status_code == 200
        if ok and expect_success:
            try:
                ok = bool(resp.json().get("success", False))
            except ValueError:
                ok = False
        if not ok:
            raise RuntimeError(
                f"SGLang {resp.request.url} answered {resp.status_code}: {printable_excerpt(resp.text, 500)}"
            )

    def _update_from_tensor(self, version: int, named_tensors) -> None:
        """One ``/update_weights_from_tensor`` per server, each in the format it takes; one
        publication per format, shared by every server taking it."""
        named = [(n, t.detach()) for n, t in named_tensors]
        builtin = self._builtin_servers()
        own = [u for u in self.server_urls if builtin[u]]
        if own:
            payload = self._tensor_payload(version, named, builtin=True)
            for resp in self._send([(f"{u}/update_weights_from_tensor", payload) for u in own]).result():
                self._check(resp, expect_success=True)
        real = [u for u in self.server_urls if not builtin[u]]
        # A real SGLang server: bucket by bucket, each a copy this process owns (torch refuses to
        # pass on CUDA memory it received from another process, as the learner's CUDA IPC weights
        # are), so the copy on the GPU is one bucket at a time, not the whole model.
        buckets = _buckets(named, self._bucket_bytes) if real else []
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            owned = [(n, t.clone() if t.is_cuda else t) for n, t in bucket]
            payload = self._tensor_payload(version, owned, builtin=False, last=last)
            for resp in self._send([(f"{u}/update_weights_from_tensor", payload) for u in real]).result():
                self._check(resp, expect_success=True)
        self._keep_alive = None

    def _builtin_servers(self) -> dict[str, bool]:
        """Which servers are the built-in engine's (``/server_info`` engine ``slime-builtin``), asked once."""
        unknown = [u for u in self.server_urls if u not in self._builtin]
        if unknown:

            async def info(url: str) -> bool:
                try:
                    resp = await self._aclient.get(f"{url}/server_info", timeout=30)
                    return resp.status_code == 200 and resp.json().get("engine") == "slime-builtin"
                except (httpx.HTTPError, ValueError, AttributeError):
                    return False

            async def infos() -> list[bool]:
                return list(await asyncio.gather(*(info(u) for u in unknown)))

            self._builtin.update(zip(unknown, self._on_loop(infos())))
        return {u: self._builtin[u] for u in self.server_urls}

    def _tensor_payload(
        self, version: int, named: list[tuple[str, torch.Tensor]], builtin: bool, last: bool = True
    ) -> dict:
        """The built-in engine's server: the JSON of a weight handle (shared memory for CPU tensors,
        CUDA IPC for CUDA tensors). A real SGLang server: its MultiprocessingSerializer format, a
        pickle in which torch turns CUDA tensors into IPC handles; SGLang accepts it only with the
        job's key (it was launched with it as --api-key)."""
        cuda = bool(named) and named[0][1].is_cuda
        if builtin and cuda:
            if self._cuda_ipc is None:
                self._cuda_ipc = CudaIpcTransport(bucket_mb=self._bucket_bytes / 2**20)
            payload, load_format = self._cuda_ipc.publish(version, named).to_json(), "slime_weight_handle"
        elif builtin:
            if self._shm is None:
                self._shm = SharedMemoryTransport(f"slime_sglang_{os.getpid()}", bucket_mb=256)
            payload, load_format = self._shm.publish(version, named).to_json(), "slime_weight_handle"
        else:
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named)
            payload, load_format = base64.b64encode(buf.getvalue()).decode(), None
            self._keep_alive = named  # the server maps this memory while it loads
        # SGLang's tensor-parallel rank r reads serialized_named_tensors[r] (and shards the whole
        # tensors itself): one entry per rank. The built-in engine's server has one rank.
        ranks = 1 if builtin else self.tensor_parallel_size
        return {
            "serialized_named_tensors": [payload] * ranks,
            "load_format": load_format,
            "flush_cache": last,
            "weight_version": str(version) if last else None,
        }

    def _write_safetensors(self, version: int, named_tensors) -> dict:
        directory = self.weights_dir / f"v{version}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().cpu().contiguous() for n, t in named_tensors}, str(directory / "model.safetensors"))
        for old in self.weights_dir.glob("v*"):
            if old != directory and old.is_dir():
                for f in old.iterdir():
                    f.unlink(missing_ok=True)
                old.rmdir()
        return {"model_path": str(directory), "weight_version": str(version)}

    def weight_checksums(self) -> None:
        """None: its weights live under its own fused and sharded names; the probe check stands alone."""
        return None

    def score_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Asked of every server directly (not through the router, which would pick one): servers
        that disagree by more than ``probe_tolerance`` (``weights.check_tolerance``) raise, naming
        both; otherwise the first server's logprobs are returned for the caller's own check."""
        ids = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids),
        }
        per_server = []
        for resp in self._send([(f"{u}/generate", body) for u in self.server_urls]).result():
            self._check(resp)
            entries = resp.json()["meta_info"]["input_token_logprobs"]
            got = [float(e[0]) for e in entries[len(entries) - len(response_ids) :]]
            if len(got) != len(response_ids):
                raise RuntimeError(
                    f"SGLang {resp.request.url} returned {len(got)} input logprobs for {len(response_ids)} probe tokens"
                )
            per_server.append(got)
        first = per_server[0]
        for url, got in zip(self.server_urls[1:], per_server[1:]):
            diff = max((abs(a - b) for a, b in zip(first, got)), default=0.0)
            if diff > self.probe_tolerance:
                raise RuntimeError(
                    f"weight-sync probe: SGLang server {url} differs from {self.server_urls[0]} by {diff:.2e} "
                    f"(> weights.check_tolerance={self.probe_tolerance}): the servers do not hold the same weights "
                    "(one missed an update?)"
                )
        return first

    def health(self) -> dict:
        """Launched processes are checked on every call; the endpoints (every server's
        /health_generate, the router's /health) at most every 10 s, because SGLang's
        /health_generate runs a generation (and waits ~1 s) when the server is idle. ``error``
        names every launched process that exited (with its log), else the first endpoint that failed."""
        if not self._closed and time.time() - self._health_at > 10:  # a closed engine's loop is stopped
            self._endpoint_error = self._check_endpoints()
            self._health_at = time.time()
        dead = self._dead_processes()
        error = "\n".join(p.exit_message() for p in dead) if dead else self._endpoint_error
        with self._cond:
            running = len(self._requests)
        return {
            "healthy": error is None,
            "error": error,
            "url": self.url,
            "server_urls": list(self.server_urls),
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
        if self._shm is not None:
            self._shm.close()
        if self._cuda_ipc is not None:
            self._cuda_ipc.close()
        for proc in reversed(self.processes):  # the router first, then its servers
            proc.stop()

    # ---- helpers --------------------------------------------------------------------------------
    def _dead_processes(self) -> list[SglangServerProcess]:
        return [p for p in self.processes if not p.alive()]

    def _check_endpoints(self) -> str | None:
        targets = [f"{u}/health_generate" for u in self.server_urls]
        if self.url not in self.server_urls:
            targets.append(f"{self.url}/health")  # the router

        async def status(url: str) -> str | None:
            try:
                code = (await self._aclient.get(url, timeout=30)).status_code
            except httpx.HTTPError as e:
                return f"GET {url} failed: {type(e).__name__}: {e}"
            return None if code == 200 else f"GET {url} answered {code}"

        async def statuses() -> list[str | None]:
            return list(await asyncio.gather(*(status(t) for t in targets)))

        return next((problem for problem in self._on_loop(statuses()) if problem is not None), None)

    def _raise_if_failed(self) -> None:
        dead = self._dead_processes()
        if not dead and self._error is not None:
            time.sleep(0.5)  # a server that died closed its streams a moment before its exit can be seen
            dead = self._dead_processes()
        if dead:
            raise RuntimeError("\n".join(p.exit_message() for p in dead))
        if self._error is not None:
            raise RuntimeError(f"SGLang generation failed: {self._error}")


def _buckets(named: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, cut into runs of at most max_bytes (a larger tensor alone)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for n, t in named:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((n, t))
        size += nbytes
    return buckets
