"""A reward that exits must fail its own call, not end the process that runs it.

`sys.exit` raises SystemExit, which the runner catches like any exception (async too: an exit
escaping a task would stop the event loop every later call waits on). `os._exit` raises nothing: it
ended the rollout worker at once (under the local launcher, the whole job) with an error that named
no reward. `guard_os_exit` replaces `os._exit` in this process with a function that, on a reward's
own threads ("reward-worker", "reward-loop", and any thread while it runs a reward inside
`reward_thread()`: a mix's sync parts on asyncio's threads, group rewards), raises SystemExit
instead; everywhere else, and in any child process forked from a reward thread (its exit is real),
it exits as before.

Nor may a reward end the event loop its async calls share: on a `RewardLoop`, a `loop.stop()` made
inside a call (`calling`) leaves the loop running and tells the call, which then fails saying so;
a KeyboardInterrupt or SystemExit escaping a task ends `run_forever`, and `serve` runs it again
(the task keeps the exception, and its call fails with it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn, TypeVar

from rewards.failure_text import exception_text

REWARD_THREADS = ("reward-worker", "reward-loop")  # the threads RewardRunner runs a reward function on

_real_os_exit = os._exit
_guarded_pid: int | None = None
_marked = threading.local()  # .depth > 0 while this thread runs a reward inside reward_thread()
T = TypeVar("T")


class RewardExited(Exception):
    """A reward function called sys.exit or os._exit; its call fails with this reason."""


def _exit_or_raise(code: int) -> NoReturn:
    on_reward = threading.current_thread().name in REWARD_THREADS or getattr(_marked, "depth", 0) > 0
    if os.getpid() == _guarded_pid and on_reward:
        raise SystemExit(f"os._exit({code})")  # the runner turns it into the call's failure
    _real_os_exit(code)


def guard_os_exit() -> None:
    """Install the guard in this process (once; a forked child's pid differs, so it exits for real)."""
    global _guarded_pid
    if _guarded_pid != os.getpid():
        _guarded_pid = os.getpid()
        os._exit = _exit_or_raise


@contextmanager
def reward_thread() -> Iterator[None]:
    """While inside, this thread runs a reward: an os._exit on it raises SystemExit (once guard_os_exit
    is installed). For threads not named in REWARD_THREADS, such as asyncio.to_thread's."""
    _marked.depth = getattr(_marked, "depth", 0) + 1
    try:
        yield
    finally:
        _marked.depth -= 1


def call_as_reward(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) inside reward_thread()."""
    with reward_thread():
        return fn(*args)


def exit_code(exc: SystemExit) -> str:
    """What a reward's exit is shown as: its code, `os._exit(N)`, or `sys.exit()`."""
    return exception_text(exc) if exc.code is not None else "sys.exit()"  # str(exc) is str(exc.code)


async def no_exit(awaitable: Awaitable[Any]) -> Any:
    """Await a reward's coroutine; a SystemExit from it becomes `RewardExited`, an ordinary exception
    that fails the call (a SystemExit escaping a task stops its event loop)."""
    try:
        return await awaitable
    except SystemExit as exc:
        raise RewardExited(f"the reward exited ({exit_code(exc)})") from exc


# The loop a call runs on and what to do if it stops it; tasks copy it from where they are created.
_stop_hook: ContextVar[tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None] = ContextVar(
    "reward_stop_hook", default=None
)


@contextmanager
def calling(loop: asyncio.AbstractEventLoop, on_stop: Callable[[], None]) -> Iterator[None]:
    """Tasks created inside (or from callbacks scheduled inside) belong to one call: a `loop.stop()`
    they make runs `on_stop` instead of stopping `loop`, a RewardLoop."""
    token = _stop_hook.set((loop, on_stop))
    try:
        yield
    finally:
        _stop_hook.reset(token)


class RewardLoop(asyncio.SelectorEventLoop):
    """An event loop serving reward calls until `halt()`; see the module docstring."""

    _halted = False

    def stop(self) -> None:
        hook = _stop_hook.get()
        if hook is not None and hook[0] is self:
            hook[1]()
        else:  # the owner's stop, run_until_complete's
            super().stop()

    def halt(self) -> None:
        """End `serve` (on the loop's thread: `loop.call_soon_threadsafe(loop.halt)`)."""
        self._halted = True
        super().stop()

    def serve(self) -> None:
        while not self._halted:
            try:
                self.run_forever()
            except (KeyboardInterrupt, SystemExit):
                pass  # raised by a reward's task, which holds it: its call fails with it
