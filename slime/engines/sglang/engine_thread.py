"""The engine thread of the built-in engine's SGLang-protocol server (`slime.engines.sglang.server`).

The engine is not thread-safe, so one thread owns it: between two steps it runs the commands
the HTTP handlers queued (`SglangProtocolServer.call`: add, abort, update weights, read state),
then steps the engine and hands each request's chunks to its `RequestStream`, an asyncio queue
on the handler's event loop. A step that raises fails the requests in flight and resets the
engine (abort all); after `MAX_CONSECUTIVE_STEP_FAILURES` in a row (or a failed reset) the thread
stops, records why, fails every queued command with `EngineStopped` and ends every open stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from itertools import chain
from typing import Any

from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationChunk, GenerationRequest
from slime.engines.sglang.protocol import ServerSettings, SharedMemorySegments

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine thread stops and /health says why


class EngineStopped(RuntimeError):
    """The engine thread is gone; every request answers 503 with the reason."""


class QueueFull(RuntimeError):
    """More waiting requests than --max-queued-requests."""


class _EngineBroken(Exception):
    """Inside the engine thread: stop serving."""


class RequestStream:
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
            self.loop.call_soon_threadsafe(
                self.events.put_nowait, GenerationChunk(self.rid, [], [], version, True, "error")
            )
        except RuntimeError:  # its event loop is closed: the server is shutting down, nobody reads it
            pass


class SglangProtocolServer:
    """State behind the HTTP app: the engine, driven only by its own thread (it is not thread-safe).

    Handlers hand work to that thread through `call` (run between two decode steps) and read
    their request's chunks from an asyncio queue the thread feeds.
    """

    def __init__(
        self,
        engine: BuiltinEngine,
        model_path: str = "",
        tokenizer=None,
        eos_token_ids: list[int] | None = None,
        settings: ServerSettings = ServerSettings(),
    ):
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids or [])
        self.settings = settings
        # every name a weight update may carry, with its shape
        model = engine.model
        self.tensor_shapes = {
            n: tuple(t.shape)
            for n, t in chain(
                model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
            )
        }
        self.streams: dict[str, RequestStream] = {}
        self.paused = False
        self.commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._commands_lock = threading.Lock()  # no command is queued after the thread drained them and stopped
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.error: str | None = None  # why the engine thread stopped
        self.last_step = time.time()
        self.step_failures = 0  # all step failures so far (consecutive ones stop the thread)
        self.shm_segments = SharedMemorySegments()  # mapped by /update_weights_from_tensor (shm handles)
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
        log.error(
            "%s (%d in a row); failing %d requests and resetting the engine\n%s",
            message,
            failures,
            len(self.streams),
            traceback.format_exc(),
        )
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
    def _add_all(self, items: list[tuple[RequestStream, GenerationRequest]]) -> None:
        """Queue the prompts of one /generate: all or none."""
        rids = [req.request_id for _, req in items]
        if len(set(rids)) != len(rids):
            raise ValueError("rid: the same rid twice in one request")
        running = next((r for r in rids if r in self.streams), None)
        if running is not None:
            raise ValueError(f"rid {running!r} is already running")
        waiting = self.engine.num_waiting()
        if waiting + len(items) > self.settings.max_queued_requests:
            raise QueueFull(
                f"{waiting} requests are waiting (--max-queued-requests {self.settings.max_queued_requests}); "
                "retry later"
            )
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
        self.shm_segments.close()

    # ---- output ---------------------------------------------------------------------------------
    def absorb(self, s: RequestStream, c: GenerationChunk) -> None:
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

    def output(self, s: RequestStream) -> dict:
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
