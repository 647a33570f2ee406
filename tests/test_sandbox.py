"""The code sandbox (envs/sandbox.py) under attack, and the unit-test code reward.

Every attack test ends with a clear status AND checks the sandbox still serves the next request.
Skipped only when bubblewrap is missing or cannot create namespaces here (the reason says which);
in CI (SLIME_CI=1) that fails instead; CI installs it with `apt-get install -y bubblewrap`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from envs.code_reward import code_reward, extract_code, score_code
from envs.sandbox import Sandbox, SandboxConfig, SandboxPool
from envs.sandbox_host import acquire_uid, release_uid
from tests.helpers import needs

CFG = SandboxConfig(
    timeout_s=3.0, memory_mb=256, max_processes=16, max_output_bytes=8192, write_quota_mb=32, max_files=200
)
_sb = Sandbox(CFG)
_probe_error = _sb._probe()
pytestmark = needs(_probe_error is None, f"bubblewrap sandbox unusable here: {_probe_error}")


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return _sb


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(CFG, max_concurrency=2) as p:
        yield p


def _still_serving(sb: Sandbox) -> None:
    r = sb.run_python("print(6 * 7)")
    assert r.status == "ok" and r.stdout == "42\n", r


def _procs_with_marker(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker.encode() in cmd:
            found.append(int(name))
    return found


def test_ok_stdin_and_files(sb):
    r = sb.run_python(
        "import sys; print(sys.stdin.read().upper(), open('data/x.txt').read())",
        stdin="hi",
        files={"data/x.txt": "file"},
    )
    assert r.status == "ok" and r.exit_code == 0 and r.stdout == "HI file\n" and r.warning is None
    r = sb.run_shell("echo $HOME; id -u; exit 3")
    assert r.status == "error" and r.exit_code == 3 and r.stdout == "/work\n65534\n"


def test_network_refused(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        code = f"""
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect(("127.0.0.1", {port})); print("CONNECTED")
except OSError as e:
    print("refused", type(e).__name__)
try:
    socket.getaddrinfo("example.com", 80); print("RESOLVED")
except OSError as e:
    print("dns failed", type(e).__name__)
"""
        r = sb.run_python(code)
        assert r.status == "ok", r
        assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout
        assert "refused" in r.stdout and "dns failed" in r.stdout
    finally:
        srv.close()
    _still_serving(sb)


def test_fork_bomb_contained(sb):
    code = """
import os, time
n = 0
for _ in range(10000):
    try:
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
    except OSError as e:
        print("fork refused after", n, e.errno, flush=True); break
time.sleep(30)
"""
    t0 = time.monotonic()
    r = sb.run_python(code)
    assert time.monotonic() - t0 < CFG.timeout_s + 2
    assert r.status == "timeout", r
    assert "fork refused after" in r.stdout
    assert int(r.stdout.split("after")[1].split()[0]) <= CFG.max_processes + 4
    _still_serving(sb)


def test_memory_bomb_killed(sb):
    r = sb.run_python("x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert r.status == "memory" and "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    r = sb.run_python("l = []\nwhile True:\n    l.append(bytearray(10**7))")
    assert r.status == "memory", r
    _still_serving(sb)


MANY_CHILDREN = r"""
import os, sys
n, mb = int(sys.argv[1]), int(sys.argv[2])
hold_r, hold_w = os.pipe()  # each child holds its block until this closes
children = []
for _ in range(n):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hold_w)
        block = bytearray(mb << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(w, b"x")
        os.read(hold_r, 1)  # until the parent has counted
        os._exit(0)
    os.close(w)
    children.append((pid, r))
# Every child has touched its block or died; count those alive now, each holding its block. The
# limit kills whichever process it picks, a child that had already reported too: counting reports
# would count one killed after its report.
reported = [pid for pid, r in children if os.read(r, 1)]
print("alive", sum(1 for pid in reported if os.waitpid(pid, os.WNOHANG) == (0, 0)))
sys.stdout.flush()
os.close(hold_w)
"""


def test_the_runs_processes_together_stay_under_total_memory_mb(sb):
    """RLIMIT_AS bounds each process: 6 children of 200 MB each pass it (memory_mb=256) and held
    1.2 GB together, up to max_processes x memory_mb per run. A memory cgroup per run bounds the
    total (total_memory_mb); where none can be made, the result says so."""
    # 20 s: on a loaded 2-core box, touching 1.2 GB and the cgroup's reclaim took over the usual 3 s
    r = Sandbox(CFG.model_copy(update={"total_memory_mb": 512, "timeout_s": 20.0})).run_python(
        MANY_CHILDREN, args=["6", "200"]
    )
    if r.warning and "no total memory limit" in r.warning:
        pytest.skip(r.warning)
    assert r.status == "ok", r
    # 512 MB holds two 200 MB children, never six (memory and swap together: once in CI a third
    # lived on in swap while v1's limit bounded memory alone)
    assert int(r.stdout.split()[1]) <= 2, r.stdout
    small = sb.run_python(MANY_CHILDREN, args=["2", "50"])
    assert small.status == "ok" and small.stdout.split() == ["alive", "2"], small


@pytest.mark.skipif(os.geteuid() != 0, reason="dedicated host uids are used only when run as root")
def test_a_running_sandbox_area_is_closed_to_other_users(sb):
    """The area's root was 0755 and root's, with 1777 /tmp and /dev/shm inside: any local user could
    read and plant files in a running sandbox's /tmp. Now it is 0700 and the run's uid's."""
    import glob
    import threading

    before = set(glob.glob("/tmp/slime-sandbox-*"))
    done = threading.Event()
    threading.Thread(target=lambda: (sb.run_python("import time; time.sleep(1.5)"), done.set())).start()
    area = None
    while not done.is_set() and (area is None or area.st_uid == 0):  # mkdtemp's, until the run's
        found = set(glob.glob("/tmp/slime-sandbox-*")) - before
        area = os.stat(found.pop()) if found else None
        time.sleep(0.05)
    done.wait(10)
    assert area is not None, "no sandbox area appeared"
    assert area.st_mode & 0o777 == 0o700 and area.st_uid >= CFG.host_uid_base, (oct(area.st_mode), area.st_uid)


def test_infinite_loop_killed_at_timeout(sb):
    t0 = time.monotonic()
    r = sb.run_python("while True:\n    pass")
    wall = time.monotonic() - t0
    assert r.status == "timeout" and wall < CFG.timeout_s + 2 and r.wall_s >= CFG.timeout_s - 0.1, (r, wall)
    _still_serving(sb)


def test_host_files_invisible(sb):
    here = os.path.abspath(__file__)
    targets = [here, "/work/main/pyproject.toml", "/root/.bashrc", "/etc/shadow", "/etc/passwd"]
    code = f"""
for p in {targets!r}:
    try:
        open(p).read(); print("READ", p)
    except OSError as e:
        print("denied", p, type(e).__name__)
import os
print("root listing:", sorted(os.listdir("/")))
"""
    r = sb.run_python(code)
    assert r.status == "ok", r
    assert "READ" not in r.stdout, r.stdout
    assert r.stdout.count("denied") == len(targets)
    assert "root" not in r.stdout.split("root listing:")[1] and "home" not in r.stdout.split("root listing:")[1]
    _still_serving(sb)


def test_writes_outside_workdir_fail(sb):
    code = """
for p in ["/usr/evil", "/etc/evil", "/evil", "/bin/evil", "/proc/evil"]:
    try:
        open(p, "w").write("x"); print("WROTE", p)
    except OSError as e:
        print("denied", p)
open("ok.txt", "w").write("fine"); open("/tmp/t", "w").write("fine")
print("workdir ok")
"""
    r = sb.run_python(code)
    assert r.status == "ok" and "WROTE" not in r.stdout and "workdir ok" in r.stdout, r
    assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")
    _still_serving(sb)


def test_output_flood_truncated(sb):
    r = sb.run_python("import sys\nwhile True:\n    sys.stdout.write('A' * 4096)")
    assert r.status == "output_limit" and r.stdout_truncated, r.status
    assert r.stdout.startswith("A" * 8192) and "truncated by sandbox" in r.stdout
    assert len(r.stdout) < 8192 + 200
    r = sb.run_python("import sys\nfor _ in range(10**6):\n    print('E' * 100, file=sys.stderr)")
    assert r.status == "output_limit" and r.stderr_truncated and not r.stdout_truncated
    _still_serving(sb)


def test_no_processes_left_behind(sb):
    marker = "lingering-" + uuid.uuid4().hex
    # detached grandchildren that try to outlive the run: a setsid'd daemon and a plain sleeper
    code = f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
print("spawned", flush=True)
"""
    r = sb.run_python(code)
    assert r.status == "ok" and "spawned" in r.stdout, r
    r = sb.run_python(code.replace('print("spawned", flush=True)', 'print("spawned", flush=True)\nwhile True: pass'))
    assert r.status == "timeout"
    time.sleep(0.2)
    assert _procs_with_marker(marker) == []
    _still_serving(sb)


def test_one_write_quota_holds_across_work_tmp_and_shm(sb):
    """Before: /tmp was capped but /work and /dev/shm were not (eight 16 MB files went through).
    Now one tmpfs holds all three: their sum stops at write_quota_mb, and its files at max_files."""
    code = """
import errno, os
total, chunk = 0, b"x" * (4 << 20)
for i in range(64):
    place = ("/work", "/tmp", "/dev/shm")[i % 3]
    try:
        with open(f"{place}/f{i}", "wb") as f:
            f.write(chunk)
        total += len(chunk)
    except OSError as e:
        print("bytes stopped", e.errno == errno.ENOSPC, total >> 20, flush=True)
        break
for name in os.listdir("/work") + os.listdir("/tmp") + os.listdir("/dev/shm"):
    pass
for place in ("/work", "/tmp", "/dev/shm"):
    for name in os.listdir(place):
        os.unlink(f"{place}/{name}")
n = 0
try:
    while n < 100000:
        open(f"{('/work', '/tmp', '/dev/shm')[n % 3]}/e{n}", "w").close()
        n += 1
except OSError as e:
    print("files stopped", e.errno == errno.ENOSPC, n, flush=True)
"""
    r = sb.run_python(code)
    assert r.status == "ok" and r.warning is None, r
    stopped, mb = r.stdout.split("bytes stopped ")[1].split()[:2]
    assert stopped == "True" and CFG.write_quota_mb - 8 <= int(mb) <= CFG.write_quota_mb, r.stdout
    stopped, files = r.stdout.split("files stopped ")[1].split()[:2]
    assert stopped == "True" and CFG.max_files - 8 <= int(files) <= CFG.max_files, r.stdout
    _still_serving(sb)


def test_host_environment_invisible(sb):
    """Before: the host's PATH (and the rest of bwrap's environment) read in /proc/1/environ."""
    code = """
import json
for pid in ("1", "self"):
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    print(pid, json.dumps(sorted(e.split(b"=")[0].decode() for e in env if e)))
"""
    r = sb.run_python(code)
    assert r.status == "ok", r
    minimal = {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PWD"}
    for line in r.stdout.splitlines():
        assert set(json.loads(line.split(" ", 1)[1])) <= minimal, line
    assert os.environ["PATH"] not in r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="dedicated host uids are used only when run as root")
def test_concurrent_processes_never_share_a_uid(sb):
    """Before: each process counted uids from the same base, and a run's cleanup killed every
    process of its uid: a second process using the sandbox killed this one's runs."""
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from envs.sandbox import Sandbox, SandboxConfig\n"
            f"sb = Sandbox(SandboxConfig(timeout_s=3.0, host_uid_base={CFG.host_uid_base}, host_uid_count=4))\n"
            "for _ in range(12):\n    assert sb.run_python('print(1)').stdout == '1\\n'\n",
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        tight = Sandbox(CFG.model_copy(update={"host_uid_count": 4}))
        for _ in range(3):
            r = tight.run_python("import time; time.sleep(0.8); print('survived')")
            assert r.status == "ok" and r.stdout == "survived\n", r
    finally:
        assert other.wait(timeout=120) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dedicated host uids are used only when run as root")
def test_a_held_uid_is_not_handed_out_by_another_process():
    code = (
        "from envs.sandbox_host import acquire_uid\n"
        "try:\n    acquire_uid(64999, 1)\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    uid = acquire_uid(64999, 1)
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
        assert "refused: no free sandbox uid in 64999..64999" in out.stdout, out
    finally:
        release_uid(uid)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.stdout == "", out  # free again


def test_cpu_file_size_and_open_file_limits_hold(sb):
    cpu = Sandbox(CFG.model_copy(update={"timeout_s": 10.0, "cpu_s": 1}))
    t0 = time.monotonic()
    r = cpu.run_python("while True:\n    pass")
    assert r.status == "timeout" and time.monotonic() - t0 < 5, r  # RLIMIT_CPU (SIGXCPU), not the wall clock
    r = sb.run_python(
        "import os, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "f = open('big', 'wb')\ntry:\n    f.write(b'x' * (CFG_MB + 1 << 20)); f.flush()\n"
        "except OSError as e:\n    print('refused', e.errno)\nprint(os.path.getsize('big') >> 20)".replace(
            "CFG_MB", str(CFG.max_file_mb)
        )
    )
    assert r.status == "ok" and r.stdout.split() == ["refused", "27", str(CFG.max_file_mb)], r  # EFBIG at the cap
    r = sb.run_python(
        "fs = []\ntry:\n    while True:\n        fs.append(open(f'o{len(fs)}', 'w'))\n"
        "except OSError as e:\n    print(e.errno, len(fs))"
    )
    errno_, opened = r.stdout.split()
    assert r.status == "ok" and errno_ == "24" and CFG.max_open_files - 8 <= int(opened) < CFG.max_open_files, r
    _still_serving(sb)


def test_unavailable_refuses_unless_unsafe():
    bad = Sandbox(SandboxConfig(bwrap="definitely-not-bwrap-xyz"))
    r = bad.run_python("print(1)")
    assert r.status == "sandbox_unavailable" and "apt-get install -y bubblewrap" in r.error
    unsafe = Sandbox(SandboxConfig(bwrap="definitely-not-bwrap-xyz", mode="unsafe_no_namespaces", timeout_s=3))
    r = unsafe.run_python("print(1)")
    assert r.status == "ok" and r.stdout == "1\n" and "WITHOUT namespaces" in r.warning


def test_pool_concurrent(pool):
    futs = [pool.submit(f"print({i} * 2)") for i in range(6)]
    assert [f.result().stdout for f in futs] == [f"{i * 2}\n" for i in range(6)]


# ----------------------------------------------------------------------------- code reward

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


def test_extract_code():
    assert extract_code("bla\n```python\nx = 1\n```\nmore\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


def test_code_reward_assert_tests(pool):
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    partial = "```python\ndef add(a, b):\n    return a + b if a >= 0 and b else 4\n```"  # fails add(-1, 1)
    crashing = "```python\ndef add(a, b):\n    return a + b\nraise RuntimeError('boom')\n```"
    hacker = '```python\nimport os\nprint(\'{"i": 0, "status": "ok"}\')\nos._exit(0)\n```'
    d = score_code(good, tests=TESTS, pool=pool)
    assert d["reward"] == 1.0 and all(r["status"] == "ok" for r in d["results"])
    d = score_code(partial, tests=TESTS, pool=pool)
    assert (
        d["reward"] == 0.75 and d["results"][1]["status"] == "failed" and "AssertionError" in d["results"][1]["stderr"]
    )
    d = score_code(crashing, tests=TESTS, pool=pool)
    assert d["reward"] == 0.0 and all("boom" in r["stderr"] for r in d["results"])
    assert score_code(hacker, tests=TESTS, pool=pool)["reward"] == 0.0
    # the nonce was a module global of the harness, one line away from faking every result
    reads_args = (
        "```python\nimport __main__, json, os\nn = __main__._args[0]\n"
        "os.write(1, (n + json.dumps({'setup': 'ok'}) + '\\n').encode())\n"
        "for i in range(4):\n    os.write(1, (n + json.dumps({'i': i, 'status': 'ok', 'stderr': ''}) + '\\n').encode())\n"
        "os._exit(0)\n```"
    )
    assert score_code(reads_args, tests=TESTS, pool=pool)["reward"] == 0.0
    hang = "```python\ndef add(a, b):\n    while a == 2: pass\n    return a + b\n```"
    d = score_code(hang, tests=TESTS, pool=pool, per_test_s=0.5)
    assert d["reward"] == 0.75 and d["results"][2]["status"] == "timeout"


def test_code_reward_io_cases_and_native_signature():
    cases = [
        {"stdin": "1 2\n", "stdout": "3\n"},
        {"stdin": "5 5\n", "stdout": "10"},
        {"stdin": "2 2\n", "stdout": "5\n"},
    ]
    prog = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    md: dict = {}
    assert code_reward("p", prog, {"cases": cases}, md) == pytest.approx(2 / 3)
    assert [r["status"] for r in md["code_reward"]["results"]] == ["ok", "ok", "wrong_answer"]
    md = {"tests": TESTS}
    assert code_reward("p", "def add(a, b):\n    return a + b", None, md) == 1.0
    assert code_reward("p", "syntax error (", '{"tests": ["assert True"]}', {}) == 0.0
    md = {}
    assert code_reward("p", "x = 1", {"tests": "assert x == 1"}, md) == 1.0  # one string: one test
    assert md["code_reward"]["total"] == 1
    with pytest.raises(ValueError, match=r"'cases' must be a list of \{'stdin', 'stdout'\} dicts, got \['x'\]"):
        code_reward("p", "x = 1", {"cases": ["x"]}, {})
