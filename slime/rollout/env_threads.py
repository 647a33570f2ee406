"""The threads a rollout worker runs env calls on (construction, reset, replay, step).

At most `size` calls run at once, each on a daemon thread (a ThreadPoolExecutor's threads are joined
at interpreter exit: one hung env call kept a finished job from exiting). A call's time limit counts
from when it starts, not from when it was queued. A call past its limit cannot be killed: the caller
writes it off, and a new thread takes its slot, so the calls queued behind it still run in their
own time; at most `max_hung` threads are written off at once, and past that the pool runs on fewer
threads (`starved` says when none is left).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EnvCall:
    """One call: its future, and when a thread started it (None while queued)."""

    __slots__ = ("args", "fn", "future", "queued_at", "started_at", "written_off")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.future: Future = Future()
        self.queued_at = time.time()
        self.started_at: float | None = None
        self.written_off = False


class EnvThreads:
    def __init__(self, size: int, max_hung: int, name: str = "env") -> None:
        self.size, self.max_hung, self.name = size, max_hung, name
        self._queue: queue.SimpleQueue[EnvCall | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._serving = 0  # threads not inside a written-off call
        self._hung = 0  # threads inside a written-off call
        self._closed = False
        with self._lock:
            for _ in range(size):
                self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any) -> EnvCall:
        call = EnvCall(fn, args)
        self._queue.put(call)
        return call

    def write_off(self, call: EnvCall) -> None:
        """`call` ran past its limit: its result will be ignored; another thread takes its slot."""
        with self._lock:
            if call.written_off or call.future.done():
                return
            call.written_off = True
            self._serving -= 1
            self._hung += 1
            if self._hung <= self.max_hung and not self._closed:
                self._spawn()

    @property
    def hung(self) -> int:
        return self._hung

    @property
    def starved(self) -> bool:
        """No thread is left to run a queued call: every slot is inside a written-off call."""
        return self._serving <= 0

    def close(self) -> None:
        """Queued calls are cancelled; running ones finish on their own (the threads are daemons)."""
        with self._lock:
            self._closed = True
            serving = self._serving
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call.future.cancel()
        for _ in range(serving):
            self._queue.put(None)

    def _spawn(self) -> None:  # under self._lock
        self._serving += 1
        threading.Thread(target=self._serve, name=f"{self.name}-{self._serving + self._hung}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            if not call.future.set_running_or_notify_cancel():
                continue
            call.started_at = time.time()
            try:
                result = call.fn(*call.args)
            except BaseException as exc:  # the caller sees it when it reads the result
                call.future.set_exception(exc)
            else:
                call.future.set_result(result)
            with self._lock:
                if not call.written_off:
                    continue
                self._hung -= 1
                if self._serving < self.size and not self._closed:
                    self._serving += 1  # no replacement took this slot (max_hung reached): serve on
                    continue
            return


def awaited(result: Any) -> Any:
    """An env's `async def` reset or step, run to its end on the env call's own thread (each call
    gets a fresh event loop); a plain result as it is."""
    return asyncio.run(result) if inspect.iscoroutine(result) else result
