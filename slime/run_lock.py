"""One job per output_dir: the driver holds an exclusive lock on output_dir/job.lock while it runs.

Two jobs in one output_dir would share its redis-server's AOF (the second stops the first's server as
a leftover and starts its own; the first's keep-alive starts it again: two servers appending to one
AOF), overwrite each other's checkpoints and job.secret, and the second's metrics.jsonl would hide
the first's. The lock is flock(2): the kernel drops it when the process ends, SIGKILL included, so a
resume after a crash never finds it held.

An output_dir that every user may write, or that another user owns, is warned about
(`check_run_dir`): its owner could plant a symlink where the job creates a file (job.lock was
ftruncate'd through one: any file of the job's user emptied) and swap the job's config.yaml or
checkpoints once written (`slime eval RUN_DIR` imports the config's reward.fn). The job's own
files are never opened through a symlink."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from slime.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE_NAME = "job.lock"


class RunDirInUse(UserError, RuntimeError):
    """Another job is running in this output_dir."""

    hint = "wait for that job to end (or stop it), or give this one another output_dir"


class RunDirUnsafe(UserError, RuntimeError):
    """Another user owns, or may write, the output_dir or a directory above it."""

    hint = "give an output_dir under a directory only you (or root) can write, e.g. under your home"


def check_run_dir(run_dir: Path) -> list[str]:
    """Warnings about who else could tamper with ``run_dir``: a directory on the way that every user
    may write (but a sticky one: /tmp), or that another user owns, or another user's symlink. They
    are warnings, not refusals: a Kubernetes emptyDir is 0777, a bind mount belongs to the host's
    user, a root job may run in a user's home. The job's own files are never opened through a
    symlink whatever this says (lock_run_dir, security.write_private)."""
    me = os.geteuid()
    trusted = {0, me}
    warnings: list[str] = []
    given = Path(os.path.abspath(run_dir))
    for part in [*reversed(given.parents), given]:  # symlinks as written: another user's may be retargeted
        st = os.lstat(part)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            warnings.append(f"{part} is a symlink of uid {st.st_uid}, who could point it elsewhere")
    real = Path(os.path.realpath(run_dir))
    for part in [*reversed(real.parents), real]:
        st = os.stat(part)
        others_write = bool(st.st_mode & stat.S_IWOTH)
        if others_write and (part == real or not st.st_mode & stat.S_ISVTX):
            warnings.append(
                f"{part} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): any of them could replace "
                "the job's files there (config.yaml, checkpoints)"
            )
        if st.st_uid not in trusted:
            warnings.append(f"{part} belongs to uid {st.st_uid}, who could replace the job's files there")
    return warnings


class RunDirNotADirectory(UserError, NotADirectoryError):
    hint = "output_dir names the directory a run writes into: give a directory's path, new or existing"


def make_run_dir(run_dir: Path) -> None:
    """Create output_dir (and its parents), or say in one line why it cannot be one."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise RunDirNotADirectory(f"output_dir {run_dir}: {exc.filename} exists and is not a directory") from None


def lock_run_dir(run_dir: Path) -> int:
    """The held lock's file descriptor (close it to release); RunDirInUse naming the holder's pid,
    RunDirUnsafe when its job.lock is a symlink; warnings for an output_dir others could tamper with (`check_run_dir`)."""
    for warning in check_run_dir(run_dir):
        log.warning("output_dir %s: %s (this user is uid %d)", run_dir, warning, os.geteuid())
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
