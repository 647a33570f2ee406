"""One job per output_dir: the driver holds an exclusive lock on output_dir/job.lock while it runs.

Two jobs in one output_dir would share its redis-server's AOF (the second stops the first's server as
a leftover and starts its own; the first's keep-alive starts it again: two servers appending to one
AOF), overwrite each other's checkpoints and job.secret, and the second's metrics.jsonl would hide
the first's. The lock is flock(2): the kernel drops it when the process ends, SIGKILL included, so a
resume after a crash never finds it held.

The output_dir must be this user's (`check_run_dir`): in a directory another user owns or may
write (one made first in /tmp, say), that user could plant a symlink where the job creates a file
(job.lock was ftruncate'd through one: any file of the job's user emptied) and swap the job's
config.yaml or checkpoints once written (`slime eval RUN_DIR` imports the config's reward.fn)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from slime.errors import UserError

LOCK_FILE_NAME = "job.lock"


class RunDirInUse(UserError, RuntimeError):
    """Another job is running in this output_dir."""

    hint = "wait for that job to end (or stop it), or give this one another output_dir"


class RunDirUnsafe(UserError, RuntimeError):
    """Another user owns, or may write, the output_dir or a directory above it."""

    hint = "give an output_dir under a directory only you (or root) can write, e.g. under your home"


def check_run_dir(run_dir: Path) -> None:
    """RunDirUnsafe unless every directory from / down to ``run_dir`` belongs to this user or root,
    no symlink on the way belongs to another user, ``run_dir`` is not writable by others, and each
    directory above it that others may write is sticky (/tmp)."""
    me = os.geteuid()
    trusted = {0, me}
    given = Path(os.path.abspath(run_dir))
    for part in [*reversed(given.parents), given]:  # symlinks as written: another user's may be retargeted
        st = os.lstat(part)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise RunDirUnsafe(
                f"output_dir {run_dir}: {part} is a symlink of uid {st.st_uid}, who could point it elsewhere"
            )
    real = Path(os.path.realpath(run_dir))
    for part in [*reversed(real.parents), real]:
        st = os.stat(part)
        if st.st_uid not in trusted:
            raise RunDirUnsafe(
                f"output_dir {run_dir}: {part} belongs to uid {st.st_uid}, not to this user (uid {me}) or root; "
                "its owner could replace the job's files there (config.yaml, checkpoints) or plant symlinks"
            )
        others_write = bool(st.st_mode & stat.S_IWOTH)
        if others_write and (part == real or not st.st_mode & stat.S_ISVTX):
            raise RunDirUnsafe(
                f"output_dir {run_dir}: {part} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}); "
                "any of them could replace the job's files there or plant symlinks"
            )


def lock_run_dir(run_dir: Path) -> int:
    """The held lock's file descriptor (close it to release); RunDirInUse naming the holder's pid,
    RunDirUnsafe for an output_dir others could tamper with (`check_run_dir`)."""
    check_run_dir(run_dir)
    try:  # never through a symlink: it would truncate the file it points to
        fd = os.open(run_dir / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RunDirUnsafe(f"output_dir {run_dir}: {LOCK_FILE_NAME} is a symlink; remove it") from None
        raise
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
