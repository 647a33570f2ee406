"""What a sandbox run takes from the host and gives back (envs/sandbox.py runs the code):

* a dedicated host uid, when we are root: RLIMIT_NPROC is per real uid and not enforced for
  root, and the run's leftovers are found and killed by their uid. A uid is held through a lock
  file (`flock`) in a root-owned directory, so two processes or two jobs on one host never run
  under the same uid and one's cleanup cannot kill the other's run; the kernel drops the lock of
  a process that dies, and the next holder first kills anything left under the uid;
* one writable area per run: a tmpfs of `size` bytes and `max_files` inodes, mounted on a fresh
  host directory, whose subdirectories become the run's `/work`, `/tmp` and `/dev/shm`. The
  kernel caps their sum, in bytes and in files (ENOSPC past either). Mounting needs root (or
  CAP_SYS_ADMIN); without it the caller falls back to per-place tmpfs and says so.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import signal
import stat
import tempfile
import threading
import time

UID_LOCK_DIR = os.path.join(tempfile.gettempdir(), "slime-sandbox-uids")
PLACES = {"work": "/work", "tmp": "/tmp", "shm": "/dev/shm"}  # subdirectory -> where the run sees it

_uid_lock = threading.Lock()
_held_uids: dict[int, int] = {}  # uid -> the fd of its lock file, open while a run uses the uid
_uid_cursor = random.randrange(1 << 30)  # round-robin from a per-process start


def acquire_uid(base: int, count: int) -> int | None:
    """A dedicated host uid in [base, base + count) when we are root, else None (run as us).
    Round-robin, so zombies not yet reaped by pid 1 spread over many uids."""
    if os.geteuid() != 0:
        return None
    _check_lock_dir()
    global _uid_cursor
    with _uid_lock:
        for _ in range(count):
            uid = base + _uid_cursor % count
            _uid_cursor += 1
            if uid in _held_uids:
                continue
            fd = os.open(os.path.join(UID_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process (or job) runs under it now
                os.close(fd)
                continue
            _held_uids[uid] = fd
            sweep_uid(uid)  # whatever a holder that died left behind
            return uid
    raise RuntimeError(
        f"no free sandbox uid in {base}..{base + count - 1}: every one is held by a run on this host "
        "(raise host_uid_count)"
    )


def release_uid(uid: int | None) -> None:
    if uid is None:
        return
    with _uid_lock:
        fd = _held_uids.pop(uid, None)
    if fd is not None:
        os.close(fd)  # drops the lock


def _check_lock_dir() -> None:
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(UID_LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise RuntimeError(f"{UID_LOCK_DIR} must be a directory owned by root and writable by it only")


def pids_of_uid(uid: int, include_zombies: bool = False) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        zombie = False
        for line in status.splitlines():
            if line.startswith("State:"):
                zombie = line.split()[1] in ("Z", "X")
            elif line.startswith("Uid:"):
                if int(line.split()[1]) == uid and (include_zombies or not zombie):
                    pids.append(int(name))
                break
    return pids


def sweep_uid(uid: int, rounds: int = 20) -> int:
    """SIGKILL every live process whose real uid is `uid`; returns how many were found.

    Zombies are skipped: they are already dead and wait for their reaper (pid 1 for orphans)."""
    found = 0
    for _ in range(rounds):
        pids = pids_of_uid(uid)
        if not pids:
            break
        found += len(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return found


def count_procs_of_uid(uid: int) -> int:
    return len(pids_of_uid(uid, include_zombies=True))


# ----------------------------------------------------------------------------- the writable area

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_mount_error: list[str | None] = []  # [why mounting is impossible here, or None], after the first try


def mount_area(root: str, size_bytes: int, max_files: int, uid: int | None) -> str | None:
    """Mount the run's writable area on the empty directory `root` and make its places (owned by
    the run's uid). None when done, else why it cannot be done here (then nothing is mounted)."""
    if _mount_error and _mount_error[0] is not None:
        return _mount_error[0]
    # nr_inodes counts the area's root and its places too
    # 0700, the run's uid's: /tmp and /dev/shm inside are 1777, so a root any user may cross would
    # let every local user read and plant files in a running sandbox's /tmp
    options = f"size={size_bytes},nr_inodes={max_files + 1 + len(PLACES)},mode=0700".encode()
    if _libc.mount(b"tmpfs", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        code = ctypes.get_errno()
        why = f"mounting a tmpfs failed ({errno.errorcode.get(code, code)}: {os.strerror(code)}; needs root or CAP_SYS_ADMIN)"
        if not _mount_error:
            _mount_error.append(why)
        return why
    if not _mount_error:
        _mount_error.append(None)
    if uid is not None:
        os.chown(root, uid, uid)
    for name in PLACES:
        path = os.path.join(root, name)
        os.mkdir(path, 0o700 if name == "work" else 0o1777)
        os.chmod(path, 0o700 if name == "work" else 0o1777)  # not narrowed by the umask
        if uid is not None:
            os.chown(path, uid, uid)
    return None


def unmount_area(root: str) -> None:
    """Detach the area (lazily: a file still open somewhere does not keep the quota alive for us)."""
    _libc.umount2(root.encode(), _MNT_DETACH)


# ----------------------------------------------------------------------------- the run's memory

_CGROUP_ROOT = "/sys/fs/cgroup"


def make_memory_cgroup(name: str, limit_bytes: int) -> tuple[str | None, str | None]:
    """A memory cgroup for one run, limited to `limit_bytes` for all its processes together (RLIMIT_AS
    is per process: without this a run holds max_processes x memory_mb). Returns (the file a pid is
    written to, to move that process in; None and why when no cgroup can be made here)."""
    v2 = os.path.join(_CGROUP_ROOT, "cgroup.controllers")
    try:
        if os.path.exists(v2):
            with open(v2) as f:
                if "memory" not in f.read().split():
                    return None, "cgroup v2 without the memory controller"
            path, limits = os.path.join(_CGROUP_ROOT, name), {"memory.max": limit_bytes, "memory.swap.max": 0}
        elif os.path.isdir(os.path.join(_CGROUP_ROOT, "memory")):
            # memory + swap too, where swap is accounted (memsw: the file is absent otherwise)
            path = os.path.join(_CGROUP_ROOT, "memory", name)
            limits = {"memory.limit_in_bytes": limit_bytes, "memory.memsw.limit_in_bytes": limit_bytes}
        else:
            return None, "no memory cgroup controller mounted"
        os.mkdir(path, 0o755)
    except OSError as exc:
        return None, f"cannot make a memory cgroup ({exc.strerror}; needs root and a writable {_CGROUP_ROOT})"
    try:
        for file, value in limits.items():
            try:
                with open(os.path.join(path, file), "w") as f:
                    f.write(str(value))
            except FileNotFoundError:
                if file not in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    raise
    except OSError as exc:  # e.g. v2 without memory delegated to child cgroups: no memory.max
        os.rmdir(path)
        return None, f"cannot limit a memory cgroup ({exc.strerror})"
    return os.path.join(path, "cgroup.procs"), None  # the parent (root) moves the run's first process in


def cgroup_oom(procs: str) -> bool:
    """Did the run's cgroup hit its limit (the kernel then killed one of its processes)?"""
    path = os.path.dirname(procs)
    try:
        with open(os.path.join(path, "memory.events")) as f:  # v2
            return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in f)
    except FileNotFoundError:
        pass
    try:
        with open(os.path.join(path, "memory.failcnt")) as f:  # v1
            return int(f.read()) > 0
    except OSError:
        return False


def remove_cgroup(procs: str) -> None:
    path = os.path.dirname(procs)
    for _ in range(50):  # the run's processes are killed; their exit takes a moment
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)
