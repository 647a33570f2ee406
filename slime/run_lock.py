"""One job per output_dir: the driver holds an exclusive lock on output_dir/job.lock while it runs.

Two jobs in one output_dir would share its redis-server's AOF (the second stops the first's server as
a leftover and starts its own; the first's keep-alive starts it again: two servers appending to one
AOF), overwrite each other's checkpoints and job.secret, and the second's metrics.jsonl would hide
the first's. The lock is flock(2): the kernel drops it when the process ends, SIGKILL included, so a
resume after a crash never finds it held."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from slime.errors import UserError

LOCK_FILE_NAME = "job.lock"


class RunDirInUse(UserError, RuntimeError):
    """Another job is running in this output_dir."""

    hint = "wait for that job to end (or stop it), or give this one another output_dir"


def lock_run_dir(run_dir: Path) -> int:
    """The held lock's file descriptor (close it to release); RunDirInUse naming the holder's pid."""
    fd = os.open(run_dir / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirInUse(
            f"output_dir {run_dir} is in use by another job (pid {holder}): two jobs would share its "
            "Redis AOF, checkpoints and metrics"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
