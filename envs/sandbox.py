"""A sandbox for untrusted Python (and shell) built on Linux namespaces through bubblewrap.

Every run gets:

* namespaces: a fresh user, pid, ipc, uts, net (no network at all, loopback down) and, where the
  kernel allows it, cgroup namespace; nested user namespaces are disabled (`--disable-userns`);
  inside, the code runs as uid/gid 65534 with no capabilities;
* a filesystem that holds only what the interpreter needs: `/usr` read-only, the `/bin`, `/lib*`
  links (or read-only binds where the host is not merged-/usr), `/etc/alternatives`,
  `/etc/ld.so.cache` and `/etc/python3*`; a fresh `/proc` and `/dev`; and the run's writable
  places `/work` (the working directory, where `files` are written), `/tmp` and `/dev/shm`, all
  in one tmpfs mounted for the run with one limit in bytes (`write_quota_mb`) and in files
  (`max_files`) for the three together (envs/sandbox_host.py; without root, /tmp and /dev/shm are
  capped apart and the result carries a warning). `/root`, `/home`, the project, `/etc/shadow`
  are simply not there;
* `--clearenv` and a minimal environment, and bwrap itself started with an empty one (its pid-1
  init's environment is readable inside); `--new-session` (no TIOCSTI into our terminal);
  `--die-with-parent`;
* rlimits (set by `prlimit` before `bwrap` is exec'd; hard = soft so the code cannot raise
  them, but for CPU: SIGXCPU at the soft limit reports a timeout, SIGKILL one second later):
  CPU seconds, address space, processes, file size, open files, no core dumps;
* when we are root, the whole tree runs as a dedicated unprivileged *host* uid, held through a
  lock file so no other process or job on the host uses it meanwhile: RLIMIT_NPROC is per real
  uid and is not enforced for root, so this is what makes the process limit bite; it also lets
  us sweep up anything left behind;
* a wall-clock timeout that SIGKILLs the process group of `bwrap`; the pid namespace then takes
  every descendant with it (the kernel kills a pid namespace when its init dies);
* stdout/stderr read incrementally and capped; past the cap the run is killed
  (status `output_limit`) and the kept output ends with a marker.

Interpreter: the system `/usr/bin/python3` by default. It lives entirely under `/usr` (stdlib
in `/usr/lib/python3.X`), so one read-only bind of `/usr` is enough; the project venv's base
interpreter lives under `/root/.pyenv` here, which must stay invisible, and the venv's heavy
packages (torch, ...) are not something untrusted code should get. Override with
`SandboxConfig.python` (+ `extra_ro_binds` for the interpreter's prefix). The settings and their
bounds are in envs/sandbox_config.py, checked when a Sandbox is built.

If `bwrap` is missing or cannot create namespaces, the sandbox refuses: every run returns status
`sandbox_unavailable` with a message naming what failed and how to fix it, unless the user sets
`mode="unsafe_no_namespaces"` (rlimits + timeout + dedicated uid only; every result then carries
a `warning`).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

from envs.sandbox_config import SandboxConfig, sandbox_config
from envs.sandbox_host import (
    PLACES,
    acquire_uid,
    cgroup_oom,
    count_procs_of_uid,
    make_memory_cgroup,
    mount_area,
    release_uid,
    remove_cgroup,
    sweep_uid,
    unmount_area,
)
from slime.errors import UserError

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed", "sandbox_unavailable"]

TRUNCATION_MARKER = "\n...[truncated by sandbox: output limit of {limit} bytes reached]\n"
UNSAFE_WARNING = (
    "sandbox ran WITHOUT namespaces (mode=unsafe_no_namespaces): no filesystem or network "
    "isolation, only rlimits, a timeout and a dedicated uid when run as root"
)
MAIN_FILE = "_sandbox_main.py"


class SandboxUnavailable(UserError, RuntimeError):
    """bwrap is missing or cannot create the namespaces we need."""

    hint = "install bubblewrap (apt-get install bubblewrap) where the sandbox runs (docs/security.md)"


@dataclass
class SandboxResult:
    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    warning: str | None = None
    error: str | None = None  # why the sandbox could not run (status sandbox_unavailable)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- probe

_probe_lock = threading.Lock()
_probe_cache: dict[tuple, str | None] = {}  # key -> None when usable, else the error message


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _fix_hint() -> str:
    hints = ["install bubblewrap (`apt-get install -y bubblewrap`)"]
    p = "/proc/sys/kernel/unprivileged_userns_clone"
    if os.path.exists(p):
        hints.append(
            f"enable unprivileged user namespaces (`sysctl -w kernel.unprivileged_userns_clone=1`, now {_read(p)})"
        )
    p = "/proc/sys/user/max_user_namespaces"
    if os.path.exists(p):
        hints.append(f"make sure `sysctl user.max_user_namespaces` > 0 (now {_read(p)})")
    p = "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"
    if os.path.exists(p):
        hints.append(
            "on Ubuntu >= 23.10 allow userns for bwrap (`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile)"
        )
    hints.append("in Docker, run with `--security-opt seccomp=unconfined` (or `--privileged`) or as root")
    hints.append('or, knowing it gives NO isolation, set mode="unsafe_no_namespaces"')
    return "; ".join(hints)


# ----------------------------------------------------------------------------- the sandbox


class Sandbox:
    def __init__(self, config: SandboxConfig | dict | None = None):
        self.config = sandbox_config(config)  # SandboxConfigError naming a setting that cannot work

    # -- availability ------------------------------------------------------------------

    def check(self) -> None:
        """Raise SandboxUnavailable (with a fix hint) unless runs can be isolated as configured."""
        err = self._probe()
        if err is not None:
            raise SandboxUnavailable(err)

    def available(self) -> bool:
        return self._probe() is None

    def _probe(self) -> str | None:
        cfg = self.config
        if cfg.mode == "unsafe_no_namespaces":
            return None
        key = (cfg.bwrap, cfg.python, os.geteuid(), tuple(cfg.extra_ro_binds))
        with _probe_lock:
            if key in _probe_cache:
                return _probe_cache[key]
            _probe_cache[key] = err = self._probe_uncached()
            return err

    def _probe_uncached(self) -> str | None:
        cfg = self.config
        bwrap = shutil.which(cfg.bwrap)
        if bwrap is None:
            return f"bubblewrap (`{cfg.bwrap}`) not found on PATH; fix: {_fix_hint()}"
        steps = [
            ("`bwrap --ro-bind / / true`", [bwrap, "--ro-bind", "/", "/", "true"]),
            (
                "bwrap with the sandbox's namespaces running the interpreter",
                self._bwrap_argv(bwrap, "/nonexistent-probe-dir") + [cfg.python, "-c", "pass"],
            ),
        ]
        for what, argv in steps:
            uid = acquire_uid(cfg.host_uid_base, cfg.host_uid_count)
            try:
                if argv[0] == bwrap and "--bind" in argv:
                    argv = [a for a in argv]  # the probe needs no /work: replace bind with tmpfs
                    i = argv.index("--bind")
                    argv[i : i + 3] = ["--tmpfs", "/work"]
                r = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                    user=uid,
                    group=uid,
                    extra_groups=[] if uid is not None else None,
                )
            except (OSError, subprocess.SubprocessError) as e:
                return f"{what} failed to start: {e}; fix: {_fix_hint()}"
            finally:
                if uid is not None:
                    sweep_uid(uid)
                release_uid(uid)
            if r.returncode != 0:
                who = f"host uid {uid}" if uid is not None else f"uid {os.geteuid()}"
                return f"{what} failed (exit {r.returncode}, as {who}): {r.stderr.strip()[-500:]}; fix: {_fix_hint()}"
        return None

    # -- argv --------------------------------------------------------------------------

    def _bwrap_argv(self, bwrap: str, area: str, quota_mounted: bool = False) -> list[str]:
        """`area`: the host directory holding the run's places (sandbox_host.PLACES). Mounted as
        one quota'd tmpfs, every place is bound from it; otherwise /tmp and /dev/shm are tmpfs
        of write_quota_mb each and /work is a host directory (RLIMIT_FSIZE per file only)."""
        cfg = self.config
        a = [
            bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid",
            "65534",
            "--gid",
            "65534",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                a += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                a += ["--ro-bind", top, top]
        for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
            a += ["--ro-bind-try", etc, etc]
        for name in sorted(os.listdir("/etc")) if os.path.isdir("/etc") else []:
            if name.startswith("python3"):
                a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for p in cfg.extra_ro_binds:
            a += ["--ro-bind", p, p]
        a += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
        ]
        if quota_mounted:
            for name, place in PLACES.items():
                a += ["--bind", os.path.join(area, name), place]
        else:
            size = str(cfg.write_quota_mb * 1024 * 1024)
            a += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm"]
            a += ["--bind", os.path.join(area, "work"), "/work"]
        a += [
            "--chdir",
            "/work",
            "--remount-ro",
            "/",
        ]  # the skeleton root tmpfs (/, /etc, ...) read-only too
        for k, v in self._env().items():
            a += ["--setenv", k, v]
        return a

    def _env(self) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/work",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
        }
        env.update(self.config.env)
        return env

    def _prlimit_argv(self, uid: int | None) -> list[str]:
        cfg = self.config
        cpu = cfg.cpu_s if cfg.cpu_s is not None else math.ceil(cfg.timeout_s) + 1
        nproc = cfg.max_processes + 4  # bwrap's monitor + its pid-1 init + slack
        # RLIMIT_NPROC counts every process of the real uid, zombies included, not just this run's:
        # our own uid when not root; leftover unreaped zombies of the dedicated uid when root
        nproc += count_procs_of_uid(os.getuid() if uid is None else uid)
        return [
            shutil.which("prlimit") or "prlimit",
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={cfg.memory_mb * 1024 * 1024}",
            f"--nproc={nproc}",
            f"--fsize={cfg.max_file_mb * 1024 * 1024}",
            f"--nofile={cfg.max_open_files}",
            "--core=0",
            "--",
        ]

    # -- public API --------------------------------------------------------------------

    def run_python(
        self, code: str, stdin: str = "", files: dict[str, str | bytes] | None = None, args: list[str] | None = None
    ) -> SandboxResult:
        files = dict(files or {})
        if MAIN_FILE in files:
            raise ValueError(f"{MAIN_FILE} is reserved")
        files[MAIN_FILE] = code
        return self._run([self.config.python, "-E", "-s", "-B", MAIN_FILE, *(args or [])], stdin, files)

    def run_shell(self, cmd: str, stdin: str = "", files: dict[str, str | bytes] | None = None) -> SandboxResult:
        return self._run(["/bin/sh", "-c", cmd], stdin, dict(files or {}))

    # -- the run -----------------------------------------------------------------------

    def _run(self, argv: list[str], stdin: str, files: dict[str, str | bytes]) -> SandboxResult:
        cfg = self.config
        unsafe = cfg.mode == "unsafe_no_namespaces"
        warning = UNSAFE_WARNING if unsafe else None
        err = self._probe()
        if err is not None:
            return SandboxResult("sandbox_unavailable", None, "", "", error=err)
        area = tempfile.mkdtemp(prefix="slime-sandbox-")
        uid = acquire_uid(cfg.host_uid_base, cfg.host_uid_count)
        cgroup, no_cgroup = make_memory_cgroup(os.path.basename(area), cfg.total_memory_mb << 20)
        no_quota = "unsafe mode" if unsafe else mount_area(area, cfg.write_quota_mb << 20, cfg.max_files, uid)
        if no_quota is not None:
            if uid is not None:  # the run's uid passes through to its work dir; no one else does
                os.chown(area, uid, uid)
            os.chmod(area, 0o700)
            os.mkdir(os.path.join(area, "work"))
            if not unsafe:
                warning = f"no total write quota ({no_quota}): /tmp and /dev/shm are capped apart, /work per file only"
        workdir = os.path.join(area, "work")
        try:
            _write_files(workdir, files, uid)
            with tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin.encode())
                stdin_file.seek(0)
                if unsafe:
                    full = self._prlimit_argv(uid) + argv
                    env, cwd = {**self._env(), "HOME": workdir, "TMPDIR": workdir}, workdir
                else:
                    bwrap = shutil.which(cfg.bwrap) or cfg.bwrap
                    full = self._prlimit_argv(uid) + self._bwrap_argv(bwrap, area, no_quota is None) + argv
                    # bwrap and its pid-1 init keep the environment they were started with (readable in
                    # /proc/1/environ inside): give them none; the code's own comes from --setenv.
                    env, cwd = {}, "/"
                res = _execute(full, stdin_file, env, cwd, uid, cfg, cgroup)
            if cgroup is not None and res.status in ("killed", "error") and cgroup_oom(cgroup):
                res.status = "memory"
            if no_cgroup is not None:
                extra = f"no total memory limit ({no_cgroup}): a run may hold max_processes x memory_mb"
                warning = f"{warning}; {extra}" if warning else extra
            res.warning = warning
            return res
        finally:
            if uid is not None:
                sweep_uid(uid)
            release_uid(uid)
            if cgroup is not None:
                remove_cgroup(cgroup)
            if no_quota is None:
                unmount_area(area)
            shutil.rmtree(area, ignore_errors=True)


def _write_files(workdir: str, files: dict[str, str | bytes], uid: int | None) -> None:
    root = os.path.realpath(workdir)
    for rel, content in files.items():
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise ValueError(f"file path must be relative and stay in the work dir: {rel!r}")
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    if uid is not None:  # the sandboxed uid owns its work dir
        for dirpath, _dirnames, filenames in os.walk(root):
            os.chown(dirpath, uid, uid)
            for n in filenames:
                os.chown(os.path.join(dirpath, n), uid, uid)


_SIGNAL_STATUS: dict[int, Status] = {
    signal.SIGXCPU: "timeout",
    signal.SIGKILL: "killed",
    signal.SIGXFSZ: "error",
}


# The run's first process: wait for the go on the pipe (fd argv[1]), close it, become argv[2:] with
# the environment it was given (/proc/self/environ: Python's start-up adds LC_CTYPE to os.environ).
# Python, not sh: a shell's redirections take one-digit fds only.
_GATE = (
    "import os, sys; fd = int(sys.argv[1]); os.read(fd, 1); os.close(fd); "
    "env = dict(e.split(b'=', 1) for e in open('/proc/self/environ', 'rb').read().split(b'\\0') if b'=' in e); "
    "os.execvpe(sys.argv[2], sys.argv[2:], env)"
)


def _execute(
    argv: list[str], stdin_file, env: dict, cwd: str, uid: int | None, cfg: SandboxConfig, cgroup: str | None = None
) -> SandboxResult:
    """Run ``argv`` under the limits. With ``cgroup`` (a memory cgroup's `cgroup.procs`), the first
    process waits on a pipe until this process (root: allowed on cgroup v1 and v2) has moved it into
    the cgroup, so everything it starts is inside."""
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout_s
    gate_r = gate_w = None
    if cgroup is not None:
        gate_r, gate_w = os.pipe()
        argv = [cfg.python, "-I", "-S", "-c", _GATE, str(gate_r), *argv]  # the interpreter the sandbox runs
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=() if gate_r is None else (gate_r,),
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
    finally:
        if gate_r is not None:
            os.close(gate_r)
    if gate_w is not None:
        try:
            with open(cgroup, "w") as procs:
                procs.write(str(proc.pid))
        except OSError as exc:  # never run it outside its memory limit
            _kill_group(proc)
            proc.wait()
            os.close(gate_w)
            proc.stdout.close()
            proc.stderr.close()
            return SandboxResult(
                "sandbox_unavailable", None, "", "", error=f"joining the run's memory cgroup failed: {exc}"
            )
        os.write(gate_w, b"go\n")
        os.close(gate_w)
    limit = cfg.max_output_bytes
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    trunc = {fd: False for fd in bufs}
    reason: Status | None = None
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    exited_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break  # something (unsafe mode) still holds the pipes: stop waiting
            for key, _ in sel.select(timeout=min(0.1, deadline - now)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = limit - len(bufs[fd])
                if len(chunk) > room:
                    bufs[fd] += chunk[: max(room, 0)]
                    trunc[fd] = True
                    reason = "output_limit"
                else:
                    bufs[fd] += chunk
            if reason is not None:
                break
    finally:
        sel.close()
        if reason is not None or proc.poll() is None:
            _kill_group(proc)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    wall = time.monotonic() - t0

    rc = proc.returncode
    # bwrap reports a signal-killed child as 128 + signo; a killed bwrap shows up as -signo
    sig = -rc if rc < 0 else (rc - 128 if 128 < rc < 160 else None)
    stdout = bufs[out_fd].decode("utf-8", "replace")
    stderr = bufs[err_fd].decode("utf-8", "replace")
    t_out, t_err = trunc[out_fd], trunc[err_fd]
    if t_out:
        stdout += TRUNCATION_MARKER.format(limit=limit)
    if t_err:
        stderr += TRUNCATION_MARKER.format(limit=limit)

    if reason is not None:
        status: Status = reason
    elif rc == 0:
        status = "ok"
    elif "MemoryError" in stderr[-4000:] or "Cannot allocate memory" in stderr[-4000:]:
        status = "memory"
    elif sig is not None and sig in _SIGNAL_STATUS:
        status = _SIGNAL_STATUS[sig]
    else:
        status = "error"
    return SandboxResult(
        status, None if reason in ("timeout", "output_limit") else rc, stdout, stderr, t_out, t_err, round(wall, 4)
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


# ----------------------------------------------------------------------------- pool / service


class SandboxPool:
    """At most `max_concurrency` sandboxes at once (threads + a semaphore); `submit` returns a Future."""

    def __init__(self, config: SandboxConfig | dict | None = None, max_concurrency: int = 4):
        self.sandbox = Sandbox(config)
        self.max_concurrency = max_concurrency
        self._sem = threading.BoundedSemaphore(max_concurrency)
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sandbox")

    def _guarded(self, fn, *a, **kw) -> SandboxResult:
        with self._sem:
            return fn(*a, **kw)

    def submit(self, code: str, stdin: str = "", files: dict[str, str | bytes] | None = None) -> Future:
        return self._executor.submit(self._guarded, self.sandbox.run_python, code, stdin, files)

    def submit_shell(self, cmd: str, stdin: str = "", files: dict[str, str | bytes] | None = None) -> Future:
        return self._executor.submit(self._guarded, self.sandbox.run_shell, cmd, stdin, files)

    def map(self, codes: list[str]) -> list[SandboxResult]:
        return [f.result() for f in [self.submit(c) for c in codes]]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxService:
    """Plain class for a Ray actor: `ray.remote(SandboxService).options(...).remote(cfg, 8)`.

    Results cross the actor boundary as plain dicts. Ray is not imported here.
    """

    def __init__(self, config: dict | None = None, max_concurrency: int = 4):
        self.pool = SandboxPool(config, max_concurrency)

    def available(self) -> bool:
        return self.pool.sandbox.available()

    def run_python(self, code: str, stdin: str = "", files: dict | None = None) -> dict:
        return self.pool.submit(code, stdin, files).result().to_dict()

    def run_shell(self, cmd: str, stdin: str = "", files: dict | None = None) -> dict:
        return self.pool.submit_shell(cmd, stdin, files).result().to_dict()

    def run_many(self, requests: list[dict]) -> list[dict]:
        """requests: [{"code": ..., "stdin": ..., "files": {...}}, ...], run concurrently."""
        futs = [self.pool.submit(r["code"], r.get("stdin", ""), r.get("files")) for r in requests]
        return [f.result().to_dict() for f in futs]


if __name__ == "__main__":  # quick manual check: python -m envs.sandbox 'print(1)'
    import sys

    print(json.dumps(Sandbox().run_python(sys.argv[1] if len(sys.argv) > 1 else "print(1)").to_dict(), indent=1))
