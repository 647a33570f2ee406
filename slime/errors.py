"""Errors in what a user gave the project (a config, a dataset, a plugin, a reward spec, a checkpoint,
the machine's or cluster's resources): each kind names its cause in its message and carries a hint
of what to do. The `slime` command prints such an error as one or two lines and exits with code 2,
without a traceback (`slime --debug ...` or `SLIME_DEBUG=1` shows it); any other exception keeps its
traceback. The kinds subclass `UserError` and the built-in error they always were (ValueError,
RuntimeError, ...), so existing handlers still catch them."""

from __future__ import annotations

import errno
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class UserError(Exception):
    """Base of the errors the CLI shows without a traceback. ``hint``: what to do, one sentence."""

    hint = ""

    def __init__(self, *args: object, hint: str | None = None):
        super().__init__(*args)
        if hint is not None:
            self.hint = hint


class ClusterError(UserError, RuntimeError):
    """The Ray cluster the config names cannot be reached or joined."""

    hint = "cluster.ray_address: leave it unset for a Ray of the job's own, or give a running cluster's address (docs/cluster.md)"


def exception_behind(exc: BaseException, kind: type[E]) -> E | None:
    """The exception of ``kind`` that ``exc`` is or was caused by (through ``raise ... from``, an
    exception raised while handling it, or a Ray task error's ``cause``); None if there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            # Ray re-raises an actor's error as RayTaskError(kind), a subclass of both whose text is
            # Ray's trace: the error itself is its cause.
            cause = getattr(current, "cause", None)
            return cause if isinstance(cause, kind) else current
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError wraps the actor's error
        current = current.__cause__ or (cause if isinstance(cause, BaseException) else None) or current.__context__
    return None


def user_error_behind(exc: BaseException) -> UserError | None:
    return exception_behind(exc, UserError)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's Python stack to stderr (a hang's first question:
    where is each thread?). Called by the driver and by each Ray actor (its own process); the
    process goes on. A no-op where SIGUSR1 does not exist (Windows). Where sys.stderr has no file
    descriptor (a test's captured stream), the process's original stderr gets the dump.

    From the main thread the dump runs as a Python signal handler: it holds the GIL, so no other
    thread's frames change under it. faulthandler's own C-level handler walks them while they run
    and can crash the process (a segfault seen under CI load); it is kept only for a caller off the
    main thread, where Python handlers cannot be installed."""
    import faulthandler
    import signal
    import sys
    import threading

    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            continue
        if threading.current_thread() is threading.main_thread():
            signal.signal(
                signal.SIGUSR1, lambda signum, frame, out=stream: faulthandler.dump_traceback(out, all_threads=True)
            )
        else:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
        return


class DiskFullError(UserError, OSError):
    """A write failed because its device is full (or over quota)."""

    hint = "free space there (or point output_dir elsewhere) and run again; resume=auto goes on from the last complete checkpoint"


def user_error_of(exc: BaseException) -> UserError | None:
    """The error to show the user for ``exc``: a UserError behind it, or a full disk (a traceback
    from deep inside a write said only "Errno 28")."""
    user = user_error_behind(exc)
    if user is not None:
        return user
    full = exception_behind(exc, OSError)
    if full is not None and full.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left on the device of {full.filename or 'a file the job writes'}")
    return None
