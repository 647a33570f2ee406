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
- ``POST /update_weights_from_disk`` (``model_path``: a directory of ``*.safetensors`` under the
  server's ``--weights-dir``), ``/update_weights_from_tensor`` (``serialized_named_tensors``: one
  entry; ``load_format`` ``"safetensors"`` = base64 safetensors bytes, ``"slime_weight_handle"``
  = the JSON form of a `slime.weights.WeightHandle` of the shared-memory or CUDA IPC transport,
  the zero-copy path). Both are in place; running requests continue with the new weights (their
  KV cache stays). SGLang's own ``load_format`` null (a pickled list) is refused.
- ``/flush_cache`` (400 while requests run, as SGLang; the engine has no prefix cache),
  ``/health`` (is the engine thread alive), ``/health_generate`` (a one-token generation when
  idle), ``/model_info`` and ``/server_info`` (also under their older names ``/get_model_info``,
  ``/get_server_info``), ``/get_load`` (``[{"dp_rank", "num_reqs", "num_waiting_reqs",
  "num_tokens"}]``): what sglang-router asks a worker for, so the real router can balance over
  several of these servers.
- ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``: this server joins the sender's group as rank
  ``rank_offset``) and ``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``:
  one broadcast from rank 0 per tensor, in that order), ``/destroy_weights_update_group``.

Text prompts need the model directory's tokenizer, and there is no radix cache.

Security (docs/security.md, docs/engines.md): no route unpickles anything. The token comes from
the environment (``SLIME_API_TOKEN``) or ``--token-file``, never argv; a non-loopback ``--host``
needs one. `slime.security.HttpGuard` checks the Host header, body sizes, JSON-only
state-changing requests and the token: every route needs it on a non-loopback bind, every
state-changing route always (``/generate`` is open on loopback, ``/health`` everywhere).
Sampling parameters and token ids are bounded (`slime.engine.validate_sampling`), as are batch
size, rids and the queue (503 when full). Disk updates load only under ``--weights-dir``; update
groups connect only to ``--update-group-hosts``, one rendezvous at a time, with a timeout. A step
that raises fails the requests in flight and resets the engine; the thread stops only after
repeated failures, and then ``/health`` says why and every open stream ends.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import collections
import json
import logging
import mmap
import os
import re
import stat
import threading
import time
import traceback
import uuid
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from slime.engine import GenerationChunk, GenerationRequest, RolloutEngine, SamplingParams, checked_token_ids, validate_sampling
from slime.security import GuardPolicy, HttpGuard, check_bind, read_token
from slime.weights import JSON_DTYPES, SHM_SEGMENT_NAME, CudaIpcTransport, WeightHandle

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine thread stops and /health says why
MAX_BODY_BYTES = 8 << 20  # a /generate of a ~1M-token context
DEFAULT_TENSOR_BODY_MB = 1024  # /update_weights_from_tensor with inline safetensors
MAX_GROUP_WORLD_SIZE = 1024
MAX_UPDATE_GROUPS = 16
LOOPBACK_GROUP_HOSTS = ("127.0.0.1", "localhost", "::1")
RID_PATTERN = r"^[A-Za-z0-9_.:@/+=\-]{1,128}$"
SHM_DIR = "/dev/shm"

Rid = Annotated[str, Field(pattern=RID_PATTERN)]


class EngineStopped(RuntimeError):
    """The engine thread is gone; every request answers 503 with the reason."""


class QueueFull(RuntimeError):
    """More waiting requests than --max-queued-requests."""


@dataclass(frozen=True)
class ServerSettings:
    """What the server accepts beyond SGLang's protocol, fixed at start."""

    weights_dir: str | None = None  # realpath; /update_weights_from_disk loads only under it (None: refused)
    update_group_hosts: frozenset[str] = frozenset(LOOPBACK_GROUP_HOSTS)  # master_address allow-list
    update_group_timeout_s: float = 60.0
    max_queued_requests: int = 256  # waiting (not yet running) requests; more answer 503
    max_batch_size: int = 256  # prompts in one /generate


class _Lenient(BaseModel):
    # SGLang clients send many more fields than this server uses; unknown ones are ignored.
    model_config = ConfigDict(extra="ignore")


class GenerateReqInput(_Lenient):
    rid: Rid | list[Rid] | None = None
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: StrictInt | None = None  # with return_logprob: input logprobs from this position on
    stream: StrictBool = False


class AbortReq(_Lenient):
    rid: str | None = Field("", max_length=128)
    abort_all: StrictBool = False


class PauseGenerationReqInput(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightFromDiskReqInput(_Lenient):
    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


class UpdateWeightsFromTensorReqInput(_Lenient):
    # One entry per tensor-parallel rank; this server is one rank.
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=1)
    load_format: str | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


class InitWeightsUpdateGroupReqInput(_Lenient):
    master_address: str = Field(min_length=1, max_length=255)
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2, le=MAX_GROUP_WORLD_SIZE)
    group_name: str = Field("weight_update_group", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_inside(self) -> "InitWeightsUpdateGroupReqInput":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedReqInput(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = Field(None, max_length=32)


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
        self.error: str | None = None  # set (before its last chunk) when the engine failed it

    def fail(self, message: str, version: int) -> None:
        """From the engine thread: end this stream with an error finish."""
        self.error = message
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, GenerationChunk(self.rid, [], [], version, True, "error"))
        except RuntimeError:  # its event loop is closed: the server is shutting down, nobody reads it
            pass


@dataclass
class _Job:
    """One prompt of a /generate, checked."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


def _sampling_params(raw: dict[str, Any] | None, eos_ids: list[int], vocab_size: int, max_seq_len: int) -> SamplingParams:
    """SGLang's sampling_params -> the engine's, checked by `validate_sampling` (ValueError naming the field)."""
    raw = dict(raw or {})
    used = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos"}
    # Fields SGLang clients often send: accepted at their neutral value, refused otherwise.
    neutral = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
               "min_new_tokens": 0, "n": 1, "stop": None, "regex": None, "json_schema": None, "ebnf": None}
    harmless = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "sampling_seed", "stream_interval"}
    unknown = set(raw) - used - set(neutral) - harmless
    if unknown:
        raise ValueError(f"sampling_params: unsupported field(s) {sorted(unknown)[:10]}")
    for key, value in neutral.items():
        if key in raw and raw[key] not in (value, [], "") and not (value is None and raw[key] is None):
            hint = "; use stop_token_ids" if key == "stop" else ""
            raise ValueError(f"sampling_params.{key}={raw[key]!r:.100} is not supported by the built-in engine{hint}")
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"sampling_params.ignore_eos must be true or false, got {ignore_eos!r:.100}")
    top_k = raw.get("top_k", -1)
    if type(top_k) is int and top_k == -1:  # SGLang's "off"
        top_k = 0
    params = SamplingParams(
        temperature=raw.get("temperature", 1.0),
        top_p=raw.get("top_p", 1.0),
        top_k=top_k,
        max_new_tokens=raw.get("max_new_tokens", min(128, max_seq_len)),
        stop_token_ids=raw.get("stop_token_ids") or [],
    )
    try:
        validate_sampling(params, vocab_size=vocab_size, max_seq_len=max_seq_len)
    except ValueError as e:
        raise ValueError(f"sampling_params.{e}") from None
    stop = list(params.stop_token_ids)
    if not ignore_eos:
        stop += [t for t in eos_ids if t not in stop]
    params.stop_token_ids = stop
    params.temperature, params.top_p = float(params.temperature), float(params.top_p)
    return params


class _SharedMemorySegments:
    """Segments of `slime.weights.SharedMemoryTransport`, mapped read-only after checks: a name of
    its pattern, a regular file directly in /dev/shm (no symlink), owned by this user. Mappings
    are kept across updates (the publisher keeps its segments) and renewed when the file changed."""

    def __init__(self):
        self._mapped: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}

    def buffers(self, names: list[str]) -> list[torch.Tensor]:
        out = []
        for name in names:
            mapping = self._map(name)
            with warnings.catch_warnings():  # read-only on purpose: the engine only copies from it
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.frombuffer(mapping, dtype=torch.uint8, count=len(mapping)))
        return out

    def _map(self, name: str) -> mmap.mmap:
        if not SHM_SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"segment {name!r} is not a slime shared-memory segment name")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
                raise ValueError(f"segment {name!r} is not a non-empty regular file of this user in {SHM_DIR}")
            key = (st.st_dev, st.st_ino, st.st_size)
            cached = self._mapped.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if cached is not None:
            self._close(cached[1])
        self._mapped[name] = (key, mapping)
        return mapping

    @staticmethod
    def _close(mapping: mmap.mmap) -> None:
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the OS frees it at exit
            pass

    def close(self) -> None:
        for _, mapping in self._mapped.values():
            self._close(mapping)
        self._mapped = {}


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class SglangProtocolServer:
    """State behind the HTTP app: the engine, driven only by its own thread (it is not thread-safe).

    Handlers hand work to that thread through `call` (run between two decode steps) and read
    their request's chunks from an asyncio queue the thread feeds.
    """

    def __init__(self, engine: RolloutEngine, model_path: str = "", tokenizer=None, eos_token_ids: list[int] | None = None,
                 settings: ServerSettings = ServerSettings()):
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids or [])
        self.settings = settings
        # every name a weight update may carry, with its shape
        model = engine.model
        self.tensor_shapes = {n: tuple(t.shape) for n, t in chain(model.named_parameters(remove_duplicate=False),
                                                                  model.named_buffers(remove_duplicate=False))}
        self.streams: dict[str, _Stream] = {}
        self.paused = False
        self.commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._commands_lock = threading.Lock()  # no command is queued after the thread drained them and stopped
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.error: str | None = None  # why the engine thread stopped
        self.last_step = time.time()
        self.step_failures = 0  # all step failures so far (consecutive ones stop the thread)
        self._shm = _SharedMemorySegments()
        self.groups: dict[str, tuple[Any, str]] = {}  # weight-update groups: name -> (group, backend)
        self.group_joining = asyncio.Lock()  # one rendezvous at a time
        self.thread = threading.Thread(target=self._run, name="sglang-protocol-engine", daemon=True)
        self.thread.start()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is stopping"
        failures = 0
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
                    try:
                        chunks = self.engine.step()
                    except Exception as e:
                        failures += 1
                        self._recover(f"engine step failed: {type(e).__name__}: {e}", failures)
                        continue
                    failures = 0
                    self._dispatch(chunks)
                    self.last_step = time.time()
                else:
                    self.wake.wait(0.01)
                    self.wake.clear()
        except _EngineBroken as e:
            reason = str(e)
        except BaseException:
            reason = f"the engine thread failed:\n{traceback.format_exc()}"
        finally:
            self._stop_serving(reason)

    def _recover(self, message: str, failures: int) -> None:
        """After a failed step: fail every request in flight (their streams end with an error),
        reset the engine (abort all), and keep serving unless this keeps happening."""
        self.step_failures += 1
        log.error("%s (%d in a row); failing %d requests and resetting the engine\n%s", message, failures,
                  len(self.streams), traceback.format_exc())
        self._fail_streams(message)
        try:
            self.engine.abort(None)
        except Exception as e:
            raise _EngineBroken(f"{message}; resetting the engine failed too: {type(e).__name__}: {e}") from e
        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineBroken(f"{failures} engine steps failed in a row; the last: {message}")

    def _fail_streams(self, message: str) -> None:
        for s in self.streams.values():
            s.fail(message, self.engine.version)
        self.streams.clear()

    def _stop_serving(self, reason: str) -> None:
        """The thread is leaving: record why, fail queued commands and end every open stream."""
        with self._commands_lock:
            self.error = reason
            pending, self.commands = list(self.commands), collections.deque()
        if reason != "the server is stopping":
            log.error("the engine thread stopped: %s", reason)
        for _, fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStopped(reason))
        self._fail_streams(f"the engine thread stopped: {reason}")

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
        fut: Future = Future()
        with self._commands_lock:
            if self.error is not None:
                raise EngineStopped(self.error)
            self.commands.append((fn, fut))
        self.wake.set()
        return await asyncio.wrap_future(fut)

    # ---- operations (each runs on the engine thread via `call`) -------------------------------
    def _add_all(self, items: list[tuple[_Stream, GenerationRequest]]) -> None:
        """Queue the prompts of one /generate: all or none."""
        rids = [req.request_id for _, req in items]
        if len(set(rids)) != len(rids):
            raise ValueError("rid: the same rid twice in one request")
        running = next((r for r in rids if r in self.streams), None)
        if running is not None:
            raise ValueError(f"rid {running!r} is already running")
        waiting = self.engine.num_waiting()
        if waiting + len(items) > self.settings.max_queued_requests:
            raise QueueFull(f"{waiting} requests are waiting (--max-queued-requests {self.settings.max_queued_requests}); "
                            "retry later")
        added: list[str] = []
        try:
            for stream, req in items:
                self.engine.add_request(req)
                added.append(req.request_id)
                self.streams[req.request_id] = stream
        except BaseException:
            self.engine.abort(added)
            for rid in added:
                self.streams.pop(rid, None)
            raise

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
            elif c.finish_reason == "error":  # SGLang reports internal errors as an abort with a status
                s.finish_reason = {"type": "abort", "message": s.error, "status_code": 500}
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

    # ---- requests -------------------------------------------------------------------------------
    def jobs(self, obj: GenerateReqInput) -> tuple[list[_Job], bool]:
        """The prompts of one /generate, every field checked (ValueError naming it)."""
        batch, batched = self._prompts(obj)
        n = len(batch)
        if not 1 <= n <= self.settings.max_batch_size:
            raise ValueError(f"input_ids: {n} prompts in one request; 1 to {self.settings.max_batch_size} are accepted")
        vocab, max_len = self.engine.vocab_size, self.engine.max_seq_len
        ids = [checked_token_ids(p, vocab_size=vocab, field_name="input_ids") for p in batch]
        if any(not p for p in ids):
            raise ValueError("input_ids: a prompt is empty")
        rids = obj.rid if isinstance(obj.rid, list) else (
            [obj.rid] if obj.rid is not None and n == 1 else [f"{obj.rid or uuid.uuid4().hex}_{i}" for i in range(n)]
        )
        samplings = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
        logprob = obj.return_logprob if isinstance(obj.return_logprob, list) else [bool(obj.return_logprob)] * n
        if not (len(rids) == len(samplings) == len(logprob) == n):
            raise ValueError("rid, sampling_params and return_logprob lists must match the number of prompts")
        bad_rid = next((r for r in rids if not re.fullmatch(RID_PATTERN, r)), None)
        if bad_rid is not None:
            raise ValueError(f"rid {bad_rid[:140]!r}: 1 to 128 characters of [A-Za-z0-9_.:@/+=-]")
        if obj.stream and batched:
            raise ValueError("stream=true supports one prompt per request")
        start = obj.logprob_start_len
        if start is not None and start >= 0:
            longest = max(len(p) for p in ids)
            if start > longest or longest > max_len:
                raise ValueError(f"logprob_start_len {start}: input logprobs need 0 <= logprob_start_len <= the prompt "
                                 f"length, and prompts of at most {max_len} tokens (the model's max_seq_len)")
        params = [_sampling_params(sp, self.eos_token_ids, vocab, max_len) for sp in samplings]
        return [_Job(r, p, sp, lp) for r, p, sp, lp in zip(rids, ids, params, logprob)], batched

    def _prompts(self, obj: GenerateReqInput) -> tuple[list, bool]:
        if obj.input_ids is not None:
            ids = obj.input_ids
            batched = bool(ids) and isinstance(ids[0], list)
            return (ids if batched else [ids]), batched
        if obj.text is None:
            raise ValueError("either input_ids or text is required")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer in the model directory; send input_ids")
        texts = obj.text if isinstance(obj.text, list) else [obj.text]
        if len(texts) > self.settings.max_batch_size:
            raise ValueError(f"text: {len(texts)} prompts in one request; at most {self.settings.max_batch_size}")
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], isinstance(obj.text, list)

    # ---- weights ------------------------------------------------------------------------------
    def check_tensors(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]], what: str) -> None:
        """Every tensor is one of this model's, with its shape (checked before any is applied)."""
        for name, shape in named_shapes:
            want = self.tensor_shapes.get(name)
            if want is None:
                raise ValueError(f"{what}: {name[:200]!r} is not a tensor of this model")
            if tuple(shape) != want:
                raise ValueError(f"{what}: {name!r} has shape {tuple(shape)}, the model's is {want}")

    def tensors_from_payload(self, payload: str, load_format: str | None) -> tuple[int | None, list]:
        """(the handle's version or None, [(name, tensor)]) from one ``serialized_named_tensors`` entry."""
        if load_format in (None, "direct"):
            raise ValueError(
                f"load_format={load_format!r} (SGLang's pickled list of (name, tensor)) is refused: this server never "
                "unpickles a request. Send load_format='safetensors' (base64 of safetensors bytes) or "
                "'slime_weight_handle' (the JSON of a slime.weights WeightHandle, shm or cuda_ipc)"
            )
        if load_format == "safetensors":
            from safetensors.torch import load

            try:
                raw = base64.b64decode(payload, validate=True)
            except binascii.Error:
                raise ValueError("load_format=safetensors: serialized_named_tensors[0] is not base64") from None
            named = list(load(raw).items())
            self.check_tensors(((n, t.shape) for n, t in named), "safetensors")
            return None, named
        if load_format == "slime_weight_handle":
            handle = WeightHandle.from_json(payload)
            if handle.transport == "cuda_ipc" and self.engine.device.type != "cuda":
                raise ValueError("slime_weight_handle: cuda_ipc handles need the engine on CUDA; send a shm handle")
            self.check_tensors(((m.name, m.shape) for m in handle.metas), "slime_weight_handle")
            if handle.transport == "cuda_ipc":
                return handle.version, list(CudaIpcTransport().receive(handle))
            buffers = self._shm.buffers(handle.buckets)
            handle.check_fits([b.numel() for b in buffers])
            named = [(m.name, buffers[m.bucket][m.offset: m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
                     for m in handle.metas]
            return handle.version, named
        raise ValueError(f"load_format={load_format!r}: expected 'safetensors' or 'slime_weight_handle'")

    def disk_files(self, model_path: str) -> list[Path]:
        """The ``*.safetensors`` of ``model_path``, which must lie under --weights-dir (symlinks resolved)."""
        root = self.settings.weights_dir
        if root is None:
            raise PermissionError("update_weights_from_disk is off: start the server with --weights-dir DIR "
                                  "(it then loads only directories under DIR)")
        directory = os.path.realpath(model_path)
        if not _within(directory, root):
            raise PermissionError(f"model_path {model_path[:300]!r} is not under the server's --weights-dir")
        files = sorted(Path(directory).glob("*.safetensors"))
        escaping = next((f for f in files if not _within(os.path.realpath(f), root)), None)
        if escaping is not None:
            raise PermissionError(f"{escaping.name} links outside the server's --weights-dir")
        if not files:
            raise ValueError(f"model_path {model_path!r} holds no *.safetensors file")
        return files


class _EngineBroken(Exception):
    """Inside the engine thread: stop serving."""


def _version(weight_version: str | None) -> int | None:
    if weight_version is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", weight_version):
        raise ValueError(f"weight_version must be a non-negative integer string for this server, got {weight_version!r}")
    return int(weight_version)


def _dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    if name not in JSON_DTYPES:
        raise ValueError(f"dtype {name[:40]!r} is not one of {list(JSON_DTYPES)}")
    return getattr(torch, name)


def guard_policy(token: str | None, host: str, max_tensor_body_mb: float = DEFAULT_TENSOR_BODY_MB) -> GuardPolicy:
    """What the guard requires here: a token for every state-changing route (and every route on a
    non-loopback bind), except ``/generate`` on loopback (it changes no server state; sglang-router
    in front of it forwards its own key anyway) and ``/health`` (liveness only: routers probe it
    without a key). ``GET /flush_cache`` is state-changing."""
    return GuardPolicy(
        token=token, bind_host=host, max_body_bytes=MAX_BODY_BYTES,
        large_body_paths={"/update_weights_from_tensor": int(max_tensor_body_mb * 2**20)},
        open_posts=frozenset({"/generate"}), open_paths=frozenset({"/health"}),
        state_changing_gets=frozenset({"/flush_cache"}),
    )


def create_app(server: SglangProtocolServer, policy: GuardPolicy) -> FastAPI:
    app = FastAPI(title="slime built-in engine, SGLang protocol")
    app.add_middleware(HttpGuard, policy=policy)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "BadRequest", "code": status}, status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(part) for part in e["loc"] if part != "body") or "body"
            problems.append(f"{where}: {e['msg']}")
        return error("; ".join(problems))

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request: Request, exc: EngineStopped):
        return error(f"the engine thread has stopped: {exc}", 503)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        return error(str(exc), 503)

    async def start(jobs: list[_Job]) -> list[_Stream]:
        loop = asyncio.get_running_loop()
        streams = [_Stream(j.rid, len(j.input_ids), j.return_logprob, loop) for j in jobs]
        items = [(s, GenerationRequest(j.rid, j.input_ids, j.params)) for s, j in zip(streams, jobs)]
        await server.call(lambda: server._add_all(items))
        return streams

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

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput):
        try:
            jobs, batched = server.jobs(obj)
            streams = await start(jobs)
        except ValueError as e:
            return error(str(e))

        if not obj.stream:
            outs = [await run_to_end(s) for s in streams]
            failed = next((s for s in streams if s.error is not None), None)
            if failed is not None:
                return error(f"request {failed.rid!r}: {failed.error}", 500)
            if obj.logprob_start_len is not None and obj.logprob_start_len >= 0:
                for out, job in zip(outs, jobs):
                    if job.return_logprob:
                        temperature = job.params.temperature
                        out["meta_info"]["input_token_logprobs"] = await input_logprobs(job.input_ids, obj.logprob_start_len, temperature)
            return outs if batched else outs[0]

        stream = streams[0]

        async def events():
            try:
                while not stream.finished:
                    server.absorb(stream, await stream.events.get())
                    yield b"data: " + json.dumps(server.output(stream)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not stream.finished:  # the client went away: stop generating for it (as SGLang)
                    try:
                        await server.call(lambda: server._abort([stream.rid]))
                    except EngineStopped:
                        pass

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq):
        await server.call(lambda: server._abort(None if obj.abort_all else [obj.rid or ""]))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await request.body()
        try:
            obj = PauseGenerationReqInput.model_validate_json(body) if body.strip() else PauseGenerationReqInput()
        except ValueError as e:
            return error(f"pause_generation: {e}")

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
            files = server.disk_files(obj.model_path)
            named = [item for f in files for item in load_file(str(f)).items()]
            server.check_tensors(((n, t.shape) for n, t in named), "update_weights_from_disk")
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            paused = await server.call(lambda: server._update(version, named))
        except PermissionError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 403)
        except (ValueError, OSError, RuntimeError) as e:
            if isinstance(e, EngineStopped):
                raise
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": paused}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput):
        try:
            version = _version(obj.weight_version)
            handle_version, named = server.tensors_from_payload(obj.serialized_named_tensors[0], obj.load_format)
            version = handle_version if version is None else version
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, named))
        except EngineStopped:
            raise
        except Exception as e:  # a bad payload, or memory this process cannot map
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, 400)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput):
        from slime.weights import join_update_group

        def refuse(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse({"success": False, "message": message}, status)

        hosts = server.settings.update_group_hosts
        if obj.master_address not in hosts:
            return refuse(f"master_address {obj.master_address!r} is not one this server accepts "
                          f"(--update-group-hosts: {sorted(hosts)})")
        if obj.backend == "nccl" and server.engine.device.type != "cuda":
            return refuse("backend=nccl needs the engine on CUDA; use gloo")
        if obj.group_name not in server.groups and len(server.groups) >= MAX_UPDATE_GROUPS:
            return refuse(f"already {len(server.groups)} weight-update groups; destroy one first")
        if server.group_joining.locked():
            return refuse("another weight-update group is being joined; retry once it is done", 409)
        async with server.group_joining:
            try:  # a rendezvous: blocks until the sender (rank 0) and every engine rank have joined
                group = await asyncio.to_thread(join_update_group, obj.master_address, obj.master_port, obj.rank_offset,
                                                obj.world_size, obj.group_name, obj.backend,
                                                server.settings.update_group_timeout_s)
            except Exception as e:
                return refuse(f"Failed to initialize the group: {e}")
        server.groups[obj.group_name] = (group, obj.backend)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput):
        from slime.weights import broadcast_from_rank0

        entry = server.groups.get(obj.group_name)
        if entry is None:
            return JSONResponse({"success": False, "message": f"no weight-update group {obj.group_name[:64]!r}; "
                                 "call /init_weights_update_group first"}, 400)
        try:
            if not (len(obj.names) == len(obj.dtypes) == len(obj.shapes)):
                raise ValueError("names, dtypes and shapes must have the same length")
            dtypes = [_dtype(d) for d in obj.dtypes]
            server.check_tensors(zip(obj.names, obj.shapes), "update_weights_from_distributed")
            version = _version(obj.weight_version)
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        group, backend = entry
        device = server.engine.device if backend == "nccl" else torch.device("cpu")

        def receive() -> list[tuple[str, torch.Tensor]]:
            named = []
            for name, dtype, shape in zip(obj.names, dtypes, obj.shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast_from_rank0(group, t)  # one broadcast per tensor, in the listed order (as SGLang)
                named.append((name, t))
            return named

        try:
            named = await asyncio.to_thread(receive)  # off the engine thread; applied between two steps
            if obj.abort_all_requests:
                await server.call(lambda: server._abort(None))
            await server.call(lambda: server._update(version, named))
        except EngineStopped:
            raise
        except (ValueError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput):
        if server.groups.pop(obj.group_name, None) is None:
            return JSONResponse({"success": False, "message": f"no weight-update group {obj.group_name[:64]!r}"}, 400)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.get("/health")
    async def health():
        """Liveness only (no generation): open to routers that probe without a key."""
        if server.error is not None:
            return error(f"the engine thread has stopped: {server.error}", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if server.error is not None:
            return error(f"the engine thread has stopped: {server.error}", 503)
        busy = await server.call(lambda: server.engine.num_running() > 0)
        if busy and time.time() - server.last_step < HEALTH_TIMEOUT_S:
            return Response(status_code=200)  # it is generating: that is the health signal
        if server.paused:
            return Response(status_code=200)
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=1)
            (stream,) = await start([_Job(f"HEALTH_CHECK_{time.time()}", [0], params, False)])
            await asyncio.wait_for(run_to_end(stream), HEALTH_TIMEOUT_S)
        except Exception as e:
            return error(f"health generation failed: {type(e).__name__}: {e}", 503)
        if stream.error is not None:
            return error(f"health generation failed: {stream.error}", 503)
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
            "step_failures": server.step_failures,
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
                 seed: int = 0, settings: ServerSettings = ServerSettings()) -> SglangProtocolServer:
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
    return SglangProtocolServer(engine, model_dir, tokenizer, eos, settings)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", dtype: str = "float32",
          max_running_requests: int = 64, seed: int = 0, torch_threads: int | None = None, *, token: str | None = None,
          settings: ServerSettings = ServerSettings(), max_tensor_body_mb: float = DEFAULT_TENSOR_BODY_MB) -> None:
    import uvicorn

    check_bind(host, token, "slime serve-sglang")  # before the model loads: refuse at once
    if torch_threads:
        torch.set_num_threads(torch_threads)
    server = build_server(model_dir, device, dtype, max_running_requests, seed, settings)
    try:
        # A bounded graceful shutdown: SIGTERM never waits on a stream for long.
        uvicorn.run(create_app(server, guard_policy(token, host, max_tensor_body_mb)), host=host, port=port,
                    log_level="warning", timeout_graceful_shutdown=5)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="slime serve-sglang", description="Serve the built-in engine over SGLang's native HTTP API.",
        allow_abbrev=False,  # `--token SECRET` must not pass for --token-file (and echo the secret as a path)
        epilog="The token comes from the environment variable SLIME_API_TOKEN or --token-file (never argv).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs a token")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests beyond the running ones; more answer 503 (default 4 x --max-running-requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--token-file", default=None, help="a file holding the token (else SLIME_API_TOKEN)")
    p.add_argument("--weights-dir", default=None,
                   help="/update_weights_from_disk loads only directories under this one (unset: the route is off)")
    p.add_argument("--update-group-hosts", default=",".join(LOOPBACK_GROUP_HOSTS),
                   help="comma-separated master_address values /init_weights_update_group may connect to")
    p.add_argument("--update-group-timeout-s", type=float, default=60.0)
    p.add_argument("--max-tensor-body-mb", type=float, default=DEFAULT_TENSOR_BODY_MB,
                   help="body limit of /update_weights_from_tensor (inline safetensors)")
    a = p.parse_args(argv)
    try:
        token = read_token(a.token_file)
        check_bind(a.host, token, "slime serve-sglang")
    except (ValueError, OSError) as e:
        raise SystemExit(f"slime serve-sglang: {e}") from None
    settings = ServerSettings(
        weights_dir=os.path.realpath(a.weights_dir) if a.weights_dir else None,
        update_group_hosts=frozenset(h.strip() for h in a.update_group_hosts.split(",") if h.strip()),
        update_group_timeout_s=a.update_group_timeout_s,
        max_queued_requests=a.max_queued_requests if a.max_queued_requests is not None else 4 * a.max_running_requests,
        max_batch_size=4 * a.max_running_requests,
    )
    serve(a.model, a.host, a.port, a.device, a.dtype, a.max_running_requests, a.seed, a.torch_threads, token=token,
          settings=settings, max_tensor_body_mb=a.max_tensor_body_mb)


if __name__ == "__main__":
    main()
