"""A reward that exits must fail its own call, not end the process that runs it.

`sys.exit` raises SystemExit, which the runner catches like any exception (async too: an exit
escaping a task would stop the event loop every later call waits on). `os._exit` raises nothing: it
ended the rollout worker at once (under the local launcher, the whole job) with an error that named
no reward. `guard_os_exit` replaces `os._exit` in this process with a function that, on a reward's
own threads ("reward-worker", "reward-loop"), raises `RewardExited` instead; everywhere else, and in
any child process forked from a reward thread (its exit is real), it exits as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable
from typing import Any, NoReturn

REWARD_THREADS = ("reward-worker", "reward-loop")  # the threads RewardRunner runs a reward function on

_real_os_exit = os._exit
_guarded_pid: int | None = None


class RewardExited(Exception):
    """A reward function called sys.exit or os._exit; its call fails with this reason."""


def _exit_or_raise(code: int) -> NoReturn:
    if os.getpid() == _guarded_pid and threading.current_thread().name in REWARD_THREADS:
        raise SystemExit(f"os._exit({code})")  # the runner turns it into the call's failure
    _real_os_exit(code)


def guard_os_exit() -> None:
    """Install the guard in this process (once; a forked child's pid differs, so it exits for real)."""
    global _guarded_pid
    if _guarded_pid != os.getpid():
        _guarded_pid = os.getpid()
        os._exit = _exit_or_raise


async def no_exit(awaitable: Awaitable[Any]) -> Any:
    """Await a reward's coroutine; a SystemExit from it becomes `RewardExited`, an ordinary exception
    that fails the call (a SystemExit escaping a task stops its event loop)."""
    try:
        return await awaitable
    except SystemExit as exc:
        raise RewardExited(f"the reward exited ({exc.code if exc.code is not None else 'sys.exit()'})") from exc
