"""The job without Ray (cluster.launcher=local): the learner and the rollout workers run on threads
of the driver's process, each behind a `LocalActor` that takes calls the way a Ray actor does.

An actor is one thread serving its calls in order, the constructor first; ``actor.method.remote(...)``
queues a call and returns a `concurrent.futures.Future` at once. A call that raises fails its
future only; a constructor that raises fails every call after it. `LocalLauncher` offers what the
fleet, the learner group and the job use of Ray (start an actor, get, wait, kill) over those
futures, so the loops, the fleet and the learner are the same code under both launchers.

What a process boundary gave and a thread cannot: killing one worker (`kill` stops serving its
calls, but a thread stuck in user code stays stuck), several learner ranks, several machines.
The config refuses those (JobConfig._check_local_launcher); a worker that hangs fails the job.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class LocalActorDead(RuntimeError):
    """A call to a local actor that was killed, or whose constructor raised."""


class _Method:
    def __init__(self, actor: LocalActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Future:
        return self.actor._call(self.name, args, kwargs)


class LocalActor:
    """An instance of ``cls`` built and called on a thread of its own, one call at a time."""

    def __init__(self, cls: type, args: tuple, kwargs: dict, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._instance: Any = None
        self._dead: str | None = None
        self._error: BaseException | None = None  # the constructor's, the cause of every later call's failure
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.ready = self._submit(lambda: self._construct(cls, args, kwargs))

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def __repr__(self) -> str:
        return f"LocalActor({self._name})"

    def _construct(self, cls: type, args: tuple, kwargs: dict) -> None:
        try:
            self._instance = cls(*args, **kwargs)
        except BaseException as exc:
            self._dead = f"its constructor raised {type(exc).__name__}: {exc}"
            self._error = exc
            raise

    def _call(self, name: str, args: tuple, kwargs: dict) -> Future:
        def run() -> Any:
            if self._dead is not None:
                raise LocalActorDead(f"{self._name}.{name}: the actor is gone ({self._dead})") from self._error
            # A future among the arguments is the result of another call, as a Ray ref would be.
            real_args = [a.result() if isinstance(a, Future) else a for a in args]
            return getattr(self._instance, name)(*real_args, **kwargs)

        return self._submit(run)

    def _submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._dead == "killed":
            future.set_exception(LocalActorDead(f"{self._name}: the actor is gone ({self._dead})"))
        else:
            self._calls.put((future, fn))
        return future

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller sees it when it gets the result, as with Ray
                future.set_exception(exc)

    def _kill(self) -> None:
        self._dead = "killed"
        while True:  # calls still queued fail now
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(LocalActorDead(f"{self._name}: killed"))
        self._calls.put(None)  # the thread ends after the call it is in, if that call ever returns


def machine_resources(num_cpus: int | None = None) -> dict[str, float]:
    """This machine's CPUs (or cluster.num_cpus) and GPUs: what a job's own Ray, or the local launcher, has."""
    import torch

    return {"CPU": float(num_cpus or os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


class LocalLauncher:
    """The launcher seam over local actors (the Ray one: slime/launch/ray_cluster.py)."""

    name = "local"

    def __init__(self, num_cpus: int | None = None) -> None:
        self.num_cpus = num_cpus  # cluster.num_cpus: the CPUs the job may count on

    timeout_error: type[BaseException] = concurrent.futures.TimeoutError
    call_errors: tuple[type[BaseException], ...] = (Exception,)  # what a failed or late call raises

    def actor(self, cls: type, *args: Any, name: str, options: dict | None = None, **kwargs: Any) -> LocalActor:
        """``cls(*args, **kwargs)`` on a thread of its own; Ray's ``options`` (resources) do not apply."""
        return LocalActor(cls, args, kwargs, name)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if isinstance(refs, Future):
            return refs.result(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        return [r.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for r in refs]

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        """The first ``num_returns`` of ``refs`` to finish (within ``timeout``), in ``refs``' order, and the rest."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [r for r in refs if r.done()]
            left = None if deadline is None else deadline - time.monotonic()
            if len(ready) >= num_returns or (left is not None and left <= 0):
                ready = ready[:num_returns]
                return ready, [r for r in refs if r not in ready]
            pending = [r for r in refs if not r.done()]
            concurrent.futures.wait(pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)

    def kill(self, actor: LocalActor) -> None:
        actor._kill()

    def placement_group(self, bundles: list[dict[str, float]], strategy: str, name: str) -> None:
        return None  # one machine: nothing to place

    def remove_placement_group(self, placement: Any) -> None:
        pass

    def cluster_resources(self) -> dict[str, float]:
        return machine_resources(self.num_cpus)

    def lost_actor(self, exc: BaseException) -> bool:
        return False  # a thread is never lost alone: whatever it raised fails the job
