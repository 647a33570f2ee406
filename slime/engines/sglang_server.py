"""The built-in engine behind SGLang's native HTTP protocol (`slime serve-sglang --model DIR`).

Tools written for an SGLang server (and our own SGLang adapter, `slime.engines.sglang`) can drive
the built-in torch engine unchanged. Request and response shapes follow SGLang's
`python/sglang/srt/entrypoints/http_server.py` and `managers/io_struct.py`:

- ``POST /generate``: ``input_ids`` (one list, or a list of lists without ``stream``),
  ``sampling_params`` (temperature, top_p, top_k (-1 = off), max_new_tokens, stop_token_ids,
  ignore_eos), ``return_logprob``, ``stream`` (SSE ``data: {...}`` events, then
  ``data: [DONE]``), ``rid``. Output: ``{"text", "output_ids", "meta_info"}`` with ``meta_info``
  holding ``id``, ``finish_reason`` (``{"type": "stop", "matched": id}``, ``{"type": "length",
  "length": n}``, ``{"type": "abort", "message": ...}`` or None while running),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version`` and, with
  ``return_logprob``, ``output_token_logprobs`` as ``[logprob, token_id, None]`` triples.
  Streamed events are cumulative (SGLang's default, without ``--incremental-streaming-output``).
- ``POST /abort_request`` (``rid`` or ``abort_all``): the aborted request's stream ends with its
  partial output and finish reason ``abort``.
- ``POST /pause_generation`` (``mode``: ``abort`` (SGLang's default) aborts everything;
  ``in_place`` and ``retract`` keep requests and their KV cache) and ``/continue_generation``.
- ``POST /update_weights_from_disk`` (``model_path``: a directory of ``*.safetensors``),
  ``/update_weights_from_tensor`` (``serialized_named_tensors``: base64 pickles, one per TP rank;
  ``load_format`` None = SGLang's list of ``(name, tensor)``, real for CUDA tensors, whose pickles
  are CUDA IPC handles; ``"slime_weight_handle"`` = a `slime.weights.WeightHandle` of the
  shared-memory or CUDA IPC transport, the zero-copy path on CPU). Both are in place; running
  requests continue with the new weights (their KV cache stays).
- ``/flush_cache`` (400 while requests run, as SGLang; the engine has no prefix cache),
  ``/health``, ``/health_generate`` (a one-token generation when idle), ``/model_info`` and
  ``/server_info`` (also under their older names ``/get_model_info``, ``/get_server_info``),
  ``/get_load`` (``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]``): what
  sglang-router asks a worker for, so the real router can balance over several of these servers.

- ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``: this server joins the sender's group as rank
  ``rank_offset``) and ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``:
  one broadcast from rank 0 per tensor, in that order), ``/destroy_weights_update_group``.

Text prompts need the model directory's tokenizer, and there is no radix cache.

Security: ``/update_weights_from_tensor`` unpickles its payload, as SGLang's does. Bind the server
to localhost or a trusted network only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import pickle
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from slime.engine import GenerationChunk, GenerationRequest, RolloutEngine, SamplingParams

HEALTH_TIMEOUT_S = 20.0


class _Lenient(BaseModel):
    # SGLang clients send many more fields than this server uses; unknown ones are ignored.
    model_config = ConfigDict(extra="ignore")


class GenerateReqInput(_Lenient):
    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | None = None  # with return_logprob: input logprobs from this position on
    stream: bool = False


class AbortReq(_Lenient):
    rid: str | None = ""
    abort_all: bool = False


class PauseGenerationReqInput(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightFromDiskReqInput(_Lenient):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromTensorReqInput(_Lenient):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupReqInput(_Lenient):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupReqInput(_Lenient):
    group_name: str = "weight_update_group"


class _Stream:
    """One request's output as SGLang reports it (cumulative), fed by the engine thread."""

    def __init__(self, rid: str, prompt_len: int, return_logprob: bool, loop: asyncio.AbstractEventLoop):
        self.rid = rid
        self.prompt_len = prompt_len
        self.return_logprob = return_logprob
        self.loop = loop
        self.events: asyncio.Queue[GenerationChunk] = asyncio.Queue()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: dict | None = None
        self.finished = False


def _sampling_params(raw: dict[str, Any] | None, eos_ids: list[int]) -> SamplingParams:
    raw = dict(raw or {})
    used = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos"}
    # Fields SGLang clients often send: accepted at their neutral value, refused otherwise.
    neutral = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
               "min_new_tokens": 0, "n": 1, "stop": None, "regex": None, "json_schema": None, "ebnf": None}
    harmless = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "sampling_seed", "stream_interval"}
    unknown = set(raw) - used - set(neutral) - harmless
    if unknown:
        raise ValueError(f"sampling_params: unsupported field(s) {sorted(unknown)}")
    for key, value in neutral.items():
        if key in raw and raw[key] not in (value, [], "") and not (value is None and raw[key] is None):
            hint = "; use stop_token_ids" if key == "stop" else ""
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by the built-in engine{hint}")
    top_k = int(raw.get("top_k", -1))
    stop = [int(t) for t in (raw.get("stop_token_ids") or [])]
    if not raw.get("ignore_eos", False):
        stop += [t for t in eos_ids if t not in stop]
    return SamplingParams(
        temperature=float(raw.get("temperature", 1.0)),
        top_p=float(raw.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        max_new_tokens=int(raw.get("max_new_tokens", 128)),
        stop_token_ids=stop,
    )


class SglangProtocolServer:
    """State behind the HTTP app: the engine, driven only by its own thread (it is not thread-safe).

    Handlers hand work to that thread through `_call` (run between two decode steps) and read
    their request's chunks from an asyncio queue the thread feeds.
    """

    def __init__(self, engine: RolloutEngine, model_path: str = "", tokenizer=None, eos_token_ids: list[int] | None = None):
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids or [])
        self.streams: dict[str, _Stream] = {}
        self.paused = False
        self.commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.error: str | None = None
        self.last_step = time.time()
        self._shm = None  # SharedMemoryTransport receiver, kept: it caches attached segments
        self.groups: dict[str, tuple[Any, str]] = {}  # weight-update groups: name -> (group, backend)
        self.thread = threading.Thread(target=self._run, name="sglang-protocol-engine", daemon=True)
        self.thread.start()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                while self.commands:
                    fn, fut = self.commands.popleft()
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as e:
                            fut.set_exception(e)
                if not self.paused and self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                    self.last_step = time.time()
                else:
                    self.wake.wait(0.01)
                    self.wake.clear()
        except Exception:
            self.error = traceback.format_exc()

    def _dispatch(self, chunks: list[GenerationChunk]) -> None:
        for c in chunks:
            s = self.streams.get(c.request_id)
            if s is None:
                continue
            s.loop.call_soon_threadsafe(s.events.put_nowait, c)
            if c.finished:
                self.streams.pop(c.request_id, None)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps; await its result."""
        if self.error is not None or not self.thread.is_alive():
            raise RuntimeError(f"the engine thread has stopped: {self.error}")
        fut: Future = Future()
        self.commands.append((fn, fut))
        self.wake.set()
        return await asyncio.wrap_future(fut)

    # ---- operations (each runs on the engine thread via `call`) -------------------------------
    def _add(self, stream: _Stream, req: GenerationRequest) -> None:
        if req.request_id in self.streams:
            raise ValueError(f"rid {req.request_id!r} is already running")
        self.engine.add_request(req)
        self.streams[req.request_id] = stream

    def _abort(self, rids: list[str] | None) -> int:
        chunks = self.engine.abort(rids)
        self._dispatch(chunks)
        return len(chunks)

    def _update(self, version: int | None, named_tensors) -> int:
        paused = self.engine.num_running() + self.engine.num_waiting()
        self.engine.update_weights(self.engine.version if version is None else version, named_tensors)
        return paused

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
        self.thread.join(timeout=10)
        if self._shm is not None:
            self._shm.close()

    # ---- output ---------------------------------------------------------------------------------
    def absorb(self, s: _Stream, c: GenerationChunk) -> None:
        s.token_ids += c.token_ids
        s.logprobs += c.logprobs
        if c.finished:
            s.finished = True
            if c.finish_reason == "stop":
                s.finish_reason = {"type": "stop", "matched": s.token_ids[-1] if s.token_ids else None}
            elif c.finish_reason == "length":
                s.finish_reason = {"type": "length", "length": len(s.token_ids)}
            else:
                s.finish_reason = {"type": "abort", "message": f"Abort request {s.rid}"}

    def output(self, s: _Stream) -> dict:
        meta = {
            "id": s.rid,
            "finish_reason": s.finish_reason,
            "prompt_tokens": s.prompt_len,
            "completion_tokens": len(s.token_ids),
            "cached_tokens": 0,
            "weight_version": str(self.engine.version),
        }
        if s.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.token_ids)]
        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(s.token_ids), "meta_info": meta}

    # ---- weights ------------------------------------------------------------------------------
    def tensors_from_payload(self, payload: bytes, load_format: str | None):
        from slime.weights import CudaIpcTransport, SharedMemoryTransport, WeightHandle

        obj = pickle.loads(payload)
        if load_format in (None, "direct"):
            if not isinstance(obj, (list, tuple)):
                raise ValueError("serialized_named_tensors: expected a pickled list of (name, tensor)")
            return [(str(n), t) for n, t in obj]
        if load_format == "slime_weight_handle":
            if not isinstance(obj, WeightHandle):
                raise ValueError("load_format=slime_weight_handle: the payload is not a slime WeightHandle")
            if obj.transport == "shm":
                if self._shm is None:
                    self._shm = SharedMemoryTransport("sglang_server")
                return obj.version, self._shm.receive(obj)
            if obj.transport == "cuda_ipc":
                return obj.version, CudaIpcTransport().receive(obj)
            raise ValueError(f"load_format=slime_weight_handle: transport {obj.transport!r} is not shm or cuda_ipc")
        raise ValueError(f"load_format={load_format!r}: expected null, 'direct' or 'slime_weight_handle'")


def _version(weight_version: str | None) -> int | None:
    if weight_version is None:
        return None
    try:
        return int(weight_version)
    except ValueError:
        raise ValueError(f"weight_version must be an integer string for this server, got {weight_version!r}") from None


def create_app(server: SglangProtocolServer) -> FastAPI:
    app = FastAPI(title="slime built-in engine, SGLang protocol")

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "BadRequest", "code": status}, status)

    async def start(rid: str, input_ids: list[int], sampling: dict | None, return_logprob: bool) -> _Stream:
        params = _sampling_params(sampling, server.eos_token_ids)
        stream = _Stream(rid, len(input_ids), return_logprob, asyncio.get_running_loop())
        await server.call(lambda: server._add(stream, GenerationRequest(rid, list(input_ids), params)))
        return stream

    async def run_to_end(stream: _Stream) -> dict:
        while not stream.finished:
            server.absorb(stream, await stream.events.get())
        return server.output(stream)

    async def input_logprobs(ids: list[int], start: int, temperature: float) -> list[list]:
        """SGLang's input_token_logprobs from position ``start``: [logprob, token_id, None] per
        input token given the tokens before it (None for the very first token)."""
        first = max(start, 1)
        lps = await server.call(lambda: server.engine.score_logprobs(ids[:first], ids[first:], temperature)) if first < len(ids) else []
        head = [[None, ids[0], None]] if start == 0 and ids else []
        return head + [[lp, t, None] for lp, t in zip(lps, ids[first:])]

    def prompts(obj: GenerateReqInput) -> tuple[list[list[int]], bool]:
        if obj.input_ids is not None:
            ids = obj.input_ids
            batched = bool(ids) and isinstance(ids[0], list)
            return (ids if batched else [ids]), batched
        if obj.text is None:
            raise ValueError("either input_ids or text is required")
        if server.tokenizer is None:
            raise ValueError("text prompts need a tokenizer in the model directory; send input_ids")
        texts = obj.text if isinstance(obj.text, list) else [obj.text]
        return [server.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], isinstance(obj.text, list)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput):
        try:
            batch, batched = prompts(obj)
            n = len(batch)
            rids = obj.rid if isinstance(obj.rid, list) else (
                [obj.rid] if obj.rid is not None and n == 1 else [f"{obj.rid or uuid.uuid4().hex}_{i}" for i in range(n)]
            )
            samplings = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
            logprob = obj.return_logprob if isinstance(obj.return_logprob, list) else [bool(obj.return_logprob)] * n
            if not (len(rids) == len(samplings) == len(logprob) == n):
                raise ValueError("rid, sampling_params and return_logprob lists must match the number of prompts")
            if obj.stream and batched:
                raise ValueError("stream=true supports one prompt per request")
            if obj.stream:
                stream = await start(rids[0], batch[0], samplings[0], logprob[0])
            else:
                streams = [await start(r, ids, sp, lp) for r, ids, sp, lp in zip(rids, batch, samplings, logprob)]
        except ValueError as e:
            return error(str(e))

        if not obj.stream:
            outs = [await run_to_end(s) for s in streams]
            if obj.logprob_start_len is not None and obj.logprob_start_len >= 0:
                for out, ids, sp, lp in zip(outs, batch, samplings, logprob):
                    if lp:
                        temperature = float((sp or {}).get("temperature", 1.0))
                        out["meta_info"]["input_token_logprobs"] = await input_logprobs(ids, obj.logprob_start_len, temperature)
            return outs if batched else outs[0]

        async def events():
            try:
                while not stream.finished:
                    server.absorb(stream, await stream.events.get())
                    yield b"data: " + json.dumps(server.output(stream)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not stream.finished:  # the client went away: stop generating for it (as SGLang)
                    await server.call(lambda: server._abort([stream.rid]))

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq):
        await server.call(lambda: server._abort(None if obj.abort_all else [obj.rid or ""]))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await request.body()
        obj = PauseGenerationReqInput.model_validate_json(body) if body.strip() else PauseGenerationReqInput()

        def pause():
            server.paused = True
            if obj.mode == "abort":
                server._abort(None)

        await server.call(pause)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        def resume():
            server.paused = False

        await server.call(resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        idle = await server.call(lambda: not server.engine.has_unfinished())
        return Response(
            content="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            status_code=200 if idle else 400,
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput):
        from safetensors.torch import load_file

        try:
            version = _version(obj.weight_version)
            files = sorted(Path(obj.model_path).glob("*.safetensors"))
            if not files:
                raise ValueError(f"model_path {obj.model_path!r} holds no *.safetensors file")
            named = [item for f in files for item in load_file(str(f)).items()]
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            paused = await server.call(lambda: server._update(version, named))
        except (ValueError, OSError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": paused}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput):
        try:
            version = _version(obj.weight_version)
            # One entry per tensor-parallel rank; this server is one rank.
            payload = base64.b64decode(obj.serialized_named_tensors[0])
            got = server.tensors_from_payload(payload, obj.load_format)
            if obj.load_format == "slime_weight_handle":
                handle_version, got = got
                version = handle_version if version is None else version
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, got))
        except Exception as e:  # a bad payload, or tensors this process cannot map (e.g. CPU fds of another process)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput):
        from slime.weights import join_update_group

        if obj.backend not in ("nccl", "gloo"):
            return JSONResponse({"success": False, "message": f"backend must be nccl or gloo, got {obj.backend!r}"}, 400)
        if obj.backend == "nccl" and server.engine.device.type != "cuda":
            return JSONResponse({"success": False, "message": "backend=nccl needs the engine on CUDA; use gloo"}, 400)
        try:  # a rendezvous: blocks until the sender (rank 0) and every engine rank have joined
            group = await asyncio.to_thread(join_update_group, obj.master_address, obj.master_port, obj.rank_offset,
                                            obj.world_size, obj.group_name, obj.backend)
        except Exception as e:
            return JSONResponse({"success": False, "message": f"Failed to initialize the group: {e}"}, 400)
        server.groups[obj.group_name] = (group, obj.backend)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput):
        from slime.weights import broadcast_from_rank0

        entry = server.groups.get(obj.group_name)
        if entry is None:
            return JSONResponse({"success": False, "message": f"no weight-update group {obj.group_name!r}; "
                                 "call /init_weights_update_group first"}, 400)
        if not (len(obj.names) == len(obj.dtypes) == len(obj.shapes)):
            return JSONResponse({"success": False, "message": "names, dtypes and shapes must have the same length"}, 400)
        group, backend = entry
        device = server.engine.device if backend == "nccl" else torch.device("cpu")

        def receive() -> list[tuple[str, torch.Tensor]]:
            named = []
            for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes):
                t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                broadcast_from_rank0(group, t)  # one broadcast per tensor, in the listed order (as SGLang)
                named.append((name, t))
            return named

        try:
            version = _version(obj.weight_version)
            named = await asyncio.to_thread(receive)  # off the engine thread; applied between two steps
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, named))
        except (ValueError, AttributeError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput):
        if server.groups.pop(obj.group_name, None) is None:
            return JSONResponse({"success": False, "message": f"no weight-update group {obj.group_name!r}"}, 400)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate():
        if server.error is not None or not server.thread.is_alive():
            return Response(status_code=503)
        busy = await server.call(lambda: server.engine.num_running() > 0)
        if busy and time.time() - server.last_step < HEALTH_TIMEOUT_S:
            return Response(status_code=200)  # it is generating: that is the health signal
        if server.paused:
            return Response(status_code=200)
        try:
            stream = await start(f"HEALTH_CHECK_{time.time()}", [0], {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}, False)
            await asyncio.wait_for(run_to_end(stream), HEALTH_TIMEOUT_S)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    # SGLang renamed /get_model_info and /get_server_info to /model_info and /server_info; both
    # names are served. sglang-router reads /server_info and /model_info when a worker registers.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": server.model_path,
            "tokenizer_path": server.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(server.engine.version),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        health = await server.call(server.engine.health)
        return {
            # the built-in engine's own state; its int "version" is the policy version, also in weight_version
            **{k: v for k, v in health.items() if k != "version"},
            "engine": "slime-builtin",
            "paused": server.paused,
            # the fields SGLang's /server_info has that routers read, with SGLang's types
            # (sglang-router drops the whole answer when one field has another type)
            "version": "slime-builtin",
            "model_path": server.model_path,
            "tokenizer_path": server.model_path,
            "served_model_name": server.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "is_embedding": False,
            "max_running_requests": getattr(server.engine, "max_running_requests", None),
            "weight_version": str(server.engine.version),
        }

    @app.get("/get_load")
    async def get_load():
        """SGLang's shape, one entry per data-parallel rank: sglang-router's ``power_of_two``
        policy sums ``num_tokens`` over them."""
        def load() -> dict:
            streams = list(server.streams.values())
            return {"num_reqs": server.engine.num_running(), "num_waiting_reqs": server.engine.num_waiting(),
                    "num_tokens": sum(s.prompt_len + len(s.token_ids) for s in streams)}

        return [{"dp_rank": 0, **await server.call(load)}]

    return app


def build_server(model_dir: str, device: str = "cpu", dtype: str = "float32", max_running_requests: int = 64,
                 seed: int = 0) -> SglangProtocolServer:
    from slime.model import load_model

    model = load_model(model_dir, dtype, device)
    tokenizer, eos = None, []
    try:
        from slime.model import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        if tokenizer.eos_token_id is not None:
            eos = [int(tokenizer.eos_token_id)]
    except Exception:  # a weights-only directory: input_ids only, no implicit EOS
        pass
    engine = RolloutEngine(model, device=device, max_running_requests=max_running_requests, seed=seed)
    return SglangProtocolServer(engine, model_dir, tokenizer, eos)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", dtype: str = "float32",
          max_running_requests: int = 64, seed: int = 0, torch_threads: int | None = None) -> None:
    import uvicorn

    if torch_threads:
        torch.set_num_threads(torch_threads)
    server = build_server(model_dir, device, dtype, max_running_requests, seed)
    try:
        uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="slime serve-sglang", description="Serve the built-in engine over SGLang's native HTTP API.")
    p.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    a = p.parse_args(argv)
    serve(a.model, a.host, a.port, a.device, a.dtype, a.max_running_requests, a.seed, a.torch_threads)


if __name__ == "__main__":
    main()
