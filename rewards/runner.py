"""Calling the user's reward function without letting it stall or crash the job.

The native reward signature (sync or async):

    def reward(prompt: str, response: str, label: Any, metadata: dict) -> float
    async def reward(prompt: str, response: str, label: Any, metadata: dict) -> float

It is called with keywords: `fn(prompt=..., response=..., label=..., metadata=...)`; `label` and
`metadata` are passed only when the function has a parameter of that name (or `**kwargs`), so
`def reward(prompt, response)` works too. It may return a number (a bool counts as 0.0/1.0) or a
dict with a "score" key (as verl allows). Other frameworks' signatures need an adapter.

`RewardRunner.submit` returns a future that always resolves to a `RewardResult` (never raises):
a reward, or `failure` saying why not (raised, timed out, not a number, NaN/inf). The timeout
counts from when the call starts running; waiting for a free slot is not counted.

Sync functions run on the runner's worker threads, `max_concurrency` of them. A sync call that
times out cannot be killed: its thread is written off as hung and a fresh worker takes its place,
so the runner keeps serving; the hung thread rejoins the pool if its call ever returns. After
`max_hung_calls` hung threads no more replacements start, and once no worker is left every call
fails at once, naming the cause. Async functions run on one event loop owned by the runner, at
most `max_concurrency` at a time; a timed-out coroutine is cancelled. An `async def` that blocks
(time.sleep instead of asyncio.sleep) stalls the loop: once a call is past its deadline and the loop
does not answer a ping, every call on that loop fails, naming the cause, and a new loop serves the
next ones (the blocked one is written off, like a hung thread, up to `max_hung_calls`). A coroutine
that stops the loop (`loop.stop()`) fails its own call; the loop serves on (rewards/exit_guard.py).

Failure reasons hold the reward's own text (an exception's message, a returned value's repr) escaped
(rewards/failure_text.py): an escape code or a line break in them cannot drive a terminal or
forge a log line, and a `__str__` or `__repr__` that raises is named instead of ending the worker.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import math
import numbers
import queue
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.exit_guard import RewardLoop, calling, guard_os_exit, no_exit
from rewards.failure_text import describe_exception, exception_text, shown, type_name
from slime.errors import UserError
from slime.sample import as_json

log = logging.getLogger(__name__)

_SIGNATURE = "fn(prompt, response, label, metadata)"


class RewardCallError(UserError, TypeError):
    """A native reward function that cannot take the native call (a required parameter never passed)."""

    hint = "docs/rewards.md, 'Plugging in a function', lists the signatures a reward function may have"


@dataclass(frozen=True)
class StepScores:
    """Per-step rewards of one response: `scores[i]` for the step whose last character is
    `ends[i]` (a character index into the response). The worker places each on the token holding
    that character (see rewards/prm.py), so PPO/GAE gets token-level rewards."""

    scores: tuple[float, ...]
    ends: tuple[int, ...]


@dataclass(frozen=True)
class RewardResult:
    reward: float | None  # None when the call failed
    failure: str | None  # why there is no reward; names the function
    latency_s: float  # time the call ran (queueing excluded)
    steps: StepScores | None = None  # per-step rewards, when the reward gives them
    info: dict[str, Any] | None = None  # extra JSON-able facts (a judge's verdict text), kept in metadata
    # The call did not finish because its runner or client closed (the job is stopping): not the
    # reward's failure. A rollout worker leaves such a sample unfinished; a resume scores it again.
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(eq=False)
class _Call:
    kwargs: dict[str, Any]
    future: Future  # Future[RewardResult]
    started: float | None = None  # time.monotonic() when it began running
    settled: bool = False  # guarded by RewardRunner._lock: the future is (being) resolved
    timed_out: bool = False
    stopped_loop: bool = False  # an async call ran loop.stop()


class RewardRunner:
    """Runs `fn` with a per-call timeout and a concurrency limit; see the module docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        timeout_s: float,
        max_concurrency: int,
        *,
        name: str | None = None,
        max_hung_calls: int | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"RewardRunner: fn must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"RewardRunner: timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"RewardRunner: max_concurrency must be >= 1, got {max_concurrency}")
        self.name = name or _describe(fn)
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.max_hung_calls = 4 * self.max_concurrency if max_hung_calls is None else int(max_hung_calls)
        self._fn = fn
        guard_os_exit()  # os._exit on a reward thread fails that call instead of ending this process
        self._pass_label, self._pass_metadata = _keyword_plan(fn, self.name)
        self._is_async = _is_async(fn)

        self._lock = threading.Lock()
        self._closed = False
        self._unsettled: set[_Call] = set()
        self._seq = itertools.count()
        # Watchdog: resolves calls whose deadline passed, whatever their thread or loop is doing.
        self._deadlines: list[tuple[float, int, _Call]] = []
        self._wake = threading.Condition(self._lock)
        self._watchdog = threading.Thread(target=self._watchdog_loop, name="reward-watchdog", daemon=True)
        self._watchdog.start()

        # Threads are daemons (not a ThreadPoolExecutor, whose workers are joined at interpreter
        # exit): a hung reward must not keep the process alive.
        self._live = 0  # worker threads serving the queue
        self._hung = 0  # written-off threads still inside a timed-out call
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._loop: RewardLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._blocked_loops = 0  # event loops written off: a coroutine blocked them
        if self._is_async:
            self._start_loop()
        else:
            with self._lock:
                for _ in range(self.max_concurrency):
                    self._spawn_worker()

    # --- public ------------------------------------------------------------------------------

    def submit(self, prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Future:
        """Start one call; the returned Future[RewardResult] always resolves, never raises."""
        kwargs: dict[str, Any] = {"prompt": prompt, "response": response}
        if self._pass_label:
            kwargs["label"] = label
        if self._pass_metadata:
            kwargs["metadata"] = dict(metadata) if metadata else {}
        future: Future = Future()
        future.set_running_or_notify_cancel()  # callers cannot cancel it; it always gets a result
        call = _Call(kwargs, future)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RewardRunner for {self.name} is closed")
            no_worker = self._blocked_loops > self.max_hung_calls if self._is_async else self._live == 0
            if not no_worker:
                self._unsettled.add(call)
                if not self._is_async:
                    self._queue.put(call)
        if no_worker:
            future.set_result(RewardResult(None, self._no_worker_message(), 0.0))
        elif self._is_async:
            assert self._loop is not None
            try:
                asyncio.run_coroutine_threadsafe(self._run_async(call), self._loop)
            except RuntimeError:  # the loop closed under a concurrent close()
                self._settle(call, None, self._closed_message(), extras={"interrupted": True})
        return future

    def score(
        self, prompt: str, response: str, label: Any = None, metadata: dict[str, Any] | None = None
    ) -> RewardResult:
        """Blocking `submit`: waits for a free slot, then at most about timeout_s."""
        return self.submit(prompt, response, label, metadata).result()

    @property
    def hung_calls(self) -> int:
        """Sync calls that timed out and are still running on a written-off thread."""
        return self._hung

    def close(self) -> None:
        """Stop the workers; calls not finished yet resolve as failures. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._unsettled)
            self._unsettled.clear()
            for call in pending:
                call.settled = True
            live = self._live
            self._wake.notify_all()
        for call in pending:
            call.future.set_result(RewardResult(None, self._closed_message(), _elapsed(call), interrupted=True))
        if self._is_async:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._loop.halt)
            except RuntimeError:
                pass  # already closed
            self._loop_thread.join(timeout=2.0)
        else:
            for _ in range(live):
                self._queue.put(None)
        self._watchdog.join(timeout=2.0)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sync path ---------------------------------------------------------------------------

    def _spawn_worker(self) -> None:  # caller holds self._lock
        self._live += 1
        threading.Thread(target=self._worker_loop, name="reward-worker", daemon=True).start()

    def _worker_loop(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            with self._lock:
                if call.settled:
                    continue
                self._start(call)
            reward, failure, extras = self._invoke_sync(call.kwargs)
            self._settle(call, reward, failure, extras=extras)
            with self._lock:
                if not call.timed_out:
                    continue
                # This thread was written off and replaced while it hung; now that it is free,
                # it rejoins only if the pool is short (max_hung_calls stopped replacements).
                self._hung -= 1
                if self._closed or self._live >= self.max_concurrency:
                    return
                self._live += 1

    def _invoke_sync(self, kwargs: dict[str, Any]) -> tuple[float | None, str | None, dict[str, Any]]:
        try:
            value = self._fn(**kwargs)
            if inspect.isawaitable(value):  # a sync wrapper that returned a coroutine
                value = asyncio.run(_await(value))
        # BaseException: a SystemExit or KeyboardInterrupt from user code must not end the worker thread
        # (a real Ctrl-C reaches only the main thread).
        except BaseException as exc:
            return None, self._raised_message(exc), {}
        return self._check(value, kwargs["response"])

    # --- async path --------------------------------------------------------------------------

    def _start_loop(self) -> None:  # at start, or holding self._lock
        self._loop = RewardLoop()
        self._semaphore = None
        self._loop_thread = threading.Thread(target=self._run_loop, args=(self._loop,), name="reward-loop", daemon=True)
        self._loop_thread.start()

    def _run_loop(self, loop: RewardLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.serve()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
        loop.close()

    def _check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """After an async call passed its deadline: a loop that does not answer a ping is blocked
        by a coroutine that never awaits. Its calls (running or queued) fail with the reason, and a
        new loop takes the next ones."""
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:
            return  # closed meanwhile
        if answered.wait(max(1.0, min(self.timeout_s, 10.0))):
            return
        with self._lock:
            if self._closed or loop is not self._loop:
                return  # closed, or this loop was replaced already
            stuck = list(self._unsettled)
            self._unsettled.clear()
            for call in stuck:
                call.settled = True
            self._blocked_loops += 1
            if self._blocked_loops <= self.max_hung_calls:
                self._start_loop()
        for call in stuck:
            call.future.set_result(RewardResult(None, self._blocked_loop_message(), _elapsed(call)))
        log.warning("%s (%d loops written off)", self._blocked_loop_message(), self._blocked_loops)

    async def _run_async(self, call: _Call) -> None:
        if call.settled:  # failed meanwhile (its loop was written off as blocked, or the runner closed)
            return
        if self._semaphore is None:  # created here: only the loop thread touches it
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            with self._lock:
                if call.settled:
                    return
                self._start(call)
            try:
                with calling(asyncio.get_running_loop(), lambda: setattr(call, "stopped_loop", True)):
                    task = asyncio.ensure_future(no_exit(self._fn(**call.kwargs)))
            except BaseException as exc:  # bad arguments, or it did not return an awaitable
                self._settle(call, None, self._raised_message(exc))
                return
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if not done or call.stopped_loop:
                task.cancel()
                self._settle(call, None, self._deadline_message(call), timed_out=not done)
                return
            try:
                value = task.result()
            except BaseException as exc:  # KeyboardInterrupt too: the loop's serve() outlived it
                self._settle(call, None, self._raised_message(exc))
                return
            reward, failure, extras = self._check(value, call.kwargs["response"])
            self._settle(call, reward, failure, extras=extras)

    # --- shared ------------------------------------------------------------------------------

    def _start(self, call: _Call) -> None:  # caller holds self._lock
        call.started = time.monotonic()
        heapq.heappush(self._deadlines, (call.started + self.timeout_s, next(self._seq), call))
        # The watchdog sleeps until the earliest deadline; only a new earliest one needs to wake it
        # (with one timeout for all calls, that is only when nothing else is running). A wakeup per
        # call is a thread switch per sample, taken from the rollout thread's share of the GIL.
        if self._deadlines[0][2] is call:
            self._wake.notify()

    def _settle(
        self,
        call: _Call,
        reward: float | None,
        failure: str | None,
        timed_out: bool = False,
        extras: dict[str, Any] | None = None,
    ) -> bool:
        with self._lock:
            if call.settled:
                return False
            call.settled = True
            call.timed_out = timed_out
            self._unsettled.discard(call)
        call.future.set_result(RewardResult(reward, failure, _elapsed(call), **(extras or {})))
        return True

    def _watchdog_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    while self._deadlines and self._deadlines[0][2].settled:
                        heapq.heappop(self._deadlines)  # finished in time: nothing to watch
                    now = time.monotonic()
                    if self._deadlines and self._deadlines[0][0] <= now:
                        break
                    self._wake.wait(self._deadlines[0][0] - now if self._deadlines else None)
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines)[2])
            for call in expired:
                self._on_deadline(call)

    def _on_deadline(self, call: _Call) -> None:
        drained: list[_Call] = []
        with self._lock:
            if call.settled:
                return
            call.settled = call.timed_out = True
            self._unsettled.discard(call)
            if not self._is_async:
                self._live -= 1
                self._hung += 1
                if not self._closed and self._hung <= self.max_hung_calls:
                    self._spawn_worker()
                elif self._live == 0:
                    drained = self._drain_queue()
            hung = self._hung
        call.future.set_result(RewardResult(None, self._deadline_message(call), _elapsed(call)))
        if self._is_async and self._loop is not None:
            loop = self._loop
            threading.Thread(target=self._check_loop, args=(loop,), name="reward-loop-check", daemon=True).start()
        for other in drained:
            other.future.set_result(RewardResult(None, self._no_worker_message(), 0.0))
        if not self._is_async:
            log.warning(
                "reward function %s timed out after %gs; its thread cannot be stopped and is written off "
                "(%d hung now, max_hung_calls=%d)",
                self.name,
                self.timeout_s,
                hung,
                self.max_hung_calls,
            )

    def _drain_queue(self) -> list[_Call]:  # caller holds self._lock
        drained = []
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if call is not None and not call.settled:
                call.settled = True
                self._unsettled.discard(call)
                drained.append(call)

    def _check(self, value: Any, response: str) -> tuple[float | None, str | None, dict[str, Any]]:
        """A returned value as (finite float, None, extras), or (None, the reason it is not one, {})."""
        who = f"reward function {self.name}"
        try:
            return check_reward_value(value, who, response)
        except BaseException as exc:  # its __float__ or __repr__ raised what check_reward_value lets pass
            return (
                None,
                f"{who} returned a value of type {type_name(value)} that could not be read: {describe_exception(exc)}",
                {},
            )

    def _raised_message(self, exc: BaseException) -> str:
        where = ""
        try:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).name != "exit_guard.py"]
            if frames:
                where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})"
        except Exception:  # a loader's get_source that raises: no location then
            pass
        return f"reward function {self.name} raised {describe_exception(exc)}{where}"

    def _deadline_message(self, call: _Call) -> str:
        if call.stopped_loop:
            return (
                f"reward function {self.name} stopped the event loop (loop.stop()); its async calls share "
                "that loop, so the call fails and the loop runs on"
            )
        return f"reward function {self.name} timed out after {self.timeout_s:g}s"

    def _blocked_loop_message(self) -> str:
        return (
            f"reward function {self.name} blocked its event loop past timeout_s={self.timeout_s:g}: an async def "
            "that calls blocking code (time.sleep, requests, a CPU-bound loop) stalls every async call; await "
            "asyncio.sleep or an async client, or make it a plain def (it then runs on threads)"
        )

    def _closed_message(self) -> str:
        return f"reward function {self.name} did not finish: the RewardRunner was closed"

    def _no_worker_message(self) -> str:
        return (
            f"reward function {self.name} not called: all worker threads are stuck in calls that timed out "
            f"({self._hung} hung, max_hung_calls={self.max_hung_calls}); fix the hang or raise timeout_s"
        )


# Rewards are trained in float32, squared by the advantage's std: 1e15² is still far from its max
# (3.4e38); a reward of 1e300 stopped the job in the learner's collate.
MAX_ABS_REWARD = 1e15


def check_reward_value(value: Any, who: str, response: str) -> tuple[float | None, str | None, dict[str, Any]]:
    """Validate what a reward returned: a number, or a dict with "score" and optionally per-step
    rewards ("step_scores" + "step_ends", character indices into `response`) and "info" (a dict).
    Returns (reward, None, extras for RewardResult) or (None, the reason, {}); `who` starts the reason."""
    extras: dict[str, Any] = {}
    try:
        if isinstance(value, Mapping):
            if "score" not in value:
                keys = shown(sorted(str(k) for k in value)[:10], 400)
                return None, f"{who} returned a dict without a 'score' key (keys: {keys})", {}
            if value.get("step_scores") is not None or value.get("step_ends") is not None:
                steps, why = _check_steps(value.get("step_scores"), value.get("step_ends"), len(response))
                if why is not None:
                    return None, f"{who} returned unusable per-step rewards: {why}", {}
                extras["steps"] = steps
            info = value.get("info")
            if info is not None:
                if not isinstance(info, Mapping):
                    return None, f"{who} returned 'info' of type {type(info).__name__}, not a dict", {}
                extras["info"] = as_json(dict(info))  # kept in the sample's metadata (a numpy value stopped the worker)
            value = value["score"]
        if value is None:
            return None, f"{who} returned None (a missing return statement?)", {}
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            return None, f"{who} returned {type_name(value)} {shown(value)}, not a number", {}
        if _is_complex(value):  # numpy's float() of one keeps the real part and drops the rest
            return None, f"{who} returned the complex number {shown(value)}, not a real one", {}
        reward = float(value)  # bool -> 0.0/1.0; numpy scalars and 1-element tensors too
    except Exception as exc:
        return None, f"{who} returned an unusable {type_name(value)}: {exception_text(exc)}", {}
    if not math.isfinite(reward):
        return None, f"{who} returned {reward}, not a finite number", {}
    if abs(reward) > MAX_ABS_REWARD:
        return None, f"{who} returned {reward:g}, beyond ±{MAX_ABS_REWARD:g} (the float32 learner would overflow)", {}
    return reward, None, extras


def _is_complex(value: Any) -> bool:
    """A complex number: Python's or numpy's scalar, or an array or tensor of a complex dtype."""
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "c" or getattr(dtype, "is_complex", False) is True


def _check_steps(scores: Any, ends: Any, response_chars: int) -> tuple[StepScores | None, str | None]:
    if not isinstance(scores, (list, tuple)) or not isinstance(ends, (list, tuple)):
        return (
            None,
            f"step_scores and step_ends must both be lists, got {type(scores).__name__} and {type(ends).__name__}",
        )
    if len(scores) != len(ends):
        return None, f"{len(scores)} step_scores but {len(ends)} step_ends"
    out_scores: list[float] = []
    out_ends: list[int] = []
    for i, (s, e) in enumerate(zip(scores, ends)):
        score = _step_score(s)
        if score is None:
            return None, f"step_scores[{i}] = {shown(s, 40)} is not a finite number"
        if abs(score) > MAX_ABS_REWARD:
            return None, f"step_scores[{i}] = {score:g} is beyond ±{MAX_ABS_REWARD:g}"
        if isinstance(e, bool) or not isinstance(e, numbers.Integral) or not 0 <= e < max(response_chars, 1):
            return (
                None,
                f"step_ends[{i}] = {shown(e, 40)} is not a character index into the {response_chars}-character response",
            )
        if out_ends and e < out_ends[-1]:
            return None, f"step_ends must not decrease (step_ends[{i}] = {e} < {out_ends[-1]})"
        out_scores.append(score)
        out_ends.append(int(e))
    return StepScores(tuple(out_scores), tuple(out_ends)), None


def _step_score(value: Any) -> float | None:
    """A step score as a finite float, taken as the top-level score is (numpy and torch scalars
    too), or None; a bool is not one."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__") or _is_complex(value):
        return None
    try:
        score = float(value)
    except Exception:  # a tensor of several numbers
        return None
    return score if math.isfinite(score) else None


def _elapsed(call: _Call) -> float:
    return time.monotonic() - call.started if call.started is not None else 0.0


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _describe(fn: Callable[..., Any]) -> str:
    target = getattr(fn, "func", fn)  # functools.partial
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _is_async(fn: Callable[..., Any]) -> bool:
    # The second test covers objects with an `async def __call__`.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (its __call__ method)


def _keyword_plan(fn: Callable[..., Any], name: str, response_param: str = "response") -> tuple[bool, bool]:
    """Whether to pass `label` and `metadata`; raises TypeError if fn cannot take the native call
    (`response_param="responses"`: a group reward's, rewards/group.py)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature (some builtins): pass everything
        return True, True
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def accepts(arg: str) -> bool:
        p = params.get(arg)
        return takes_kwargs or (p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    missing = [arg for arg in ("prompt", response_param) if not accepts(arg)]
    native = {"prompt", response_param, "label", "metadata"}
    unsupplied = [
        n
        for n, p in params.items()
        if n not in native and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing or unsupplied:
        why = (
            f"does not take {missing} as keyword arguments"
            if missing
            else f"requires {unsupplied}, which are never passed"
        )
        raise RewardCallError(
            f"reward function {name}{sig} {why}; the native reward signature is {_SIGNATURE} "
            f"(see rewards/runner.py); other signatures need an adapter"
        )
    return accepts("label"), accepts("metadata")
