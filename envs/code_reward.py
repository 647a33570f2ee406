"""Unit-test-based code reward, executed only inside the sandbox (envs/sandbox.py).

A problem carries either or both of
  tests: ["assert f(1) == 2", ...]                 assert statements run after the solution
  cases: [{"stdin": "1 2\\n", "stdout": "3\\n"}]     the solution is run as a program per case
reward = passed / total (0.0 when there is nothing to run).

`score_code(response, tests=..., cases=...)` returns a dict with the reward and per-test results
(passed, status, stderr tail) for the caller to keep in the sample's metadata.

`code_reward(prompt, response, label, metadata)` is the native reward function: it reads the
tests from `label` first (a dict, or a JSON string of one, with keys "tests" / "cases"; a list
is taken as "tests"), falling back to `metadata["tests"]` / `metadata["cases"]`; it stores the
details under `metadata["code_reward"]` when `metadata` is a dict.

Assert tests run in ONE sandbox run per response (cheap); each test gets its own try/except and a
per-test alarm, so one failing or hanging test does not hide the others. Results are reported on
the original stdout fd tagged with a per-run random nonce, so a solution that prints fake result
lines or exits early with status 0 does not pass. It still shares an interpreter with the tests,
so a solution written to inspect the harness could fake results; use `cases` (separate process
per case, output compared outside the sandbox) where that matters.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from typing import Any

from envs.sandbox import Sandbox, SandboxConfig, SandboxPool

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last ```python (or ```py) block; else the last fenced block; else the whole text."""
    blocks = _FENCE.findall(response or "")
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return response or ""


_HARNESS = r"""
import json as _json, os as _os, signal as _signal, sys as _sys, traceback as _tb
def _harness(_nonce, _solution, _tests, _per_test_s):
    _fd = _os.dup(1)
    def _report(obj):
        _os.write(_fd, (_nonce + _json.dumps(obj) + "\n").encode())
    class _Alarm(BaseException):
        pass
    def _on_alarm(*_):
        raise _Alarm()
    _signal.signal(_signal.SIGALRM, _on_alarm)
    _ns = {"__name__": "__main__"}
    try:
        _signal.setitimer(_signal.ITIMER_REAL, _per_test_s * 2)
        exec(compile(_solution, "solution.py", "exec"), _ns)
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    except BaseException as _e:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _st = "timeout" if isinstance(_e, _Alarm) else ("memory" if isinstance(_e, MemoryError) else "error")
        _report({"setup": _st, "stderr": _tb.format_exc()[-1000:]})
        return
    _report({"setup": "ok"})
    for _i, _t in enumerate(_tests):
        _st, _err = "ok", ""
        try:
            _signal.setitimer(_signal.ITIMER_REAL, _per_test_s)
            exec(compile(_t, "test_%d" % _i, "exec"), _ns)
            _signal.setitimer(_signal.ITIMER_REAL, 0)
        except BaseException as _e:
            _signal.setitimer(_signal.ITIMER_REAL, 0)
            _st = ("timeout" if isinstance(_e, _Alarm) else "failed" if isinstance(_e, AssertionError)
                   else "memory" if isinstance(_e, MemoryError) else "error")
            _err = _tb.format_exc()[-1000:]
        _report({"i": _i, "status": _st, "stderr": _err})
_harness(*_json.loads(_sys.stdin.readline()))  # no module global holds the nonce
"""


def _tail(s: str, n: int = 1000) -> str:
    return s[-n:]


def _norm(out: str) -> list[str]:
    lines = [ln.rstrip() for ln in out.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_assert_tests(code: str, tests: list[str], sandbox: Sandbox, per_test_s: float = 2.0) -> list[dict]:
    nonce = "@@" + secrets.token_hex(16) + "@@"
    # the args travel on stdin (a one-shot pipe read), not in the script the solution could read
    res = sandbox.run_python(_HARNESS, stdin=json.dumps([nonce, code, tests, per_test_s]) + "\n")
    reported: dict[int, dict] = {}
    setup: dict | None = None
    for line in res.stdout.splitlines():
        if not line.startswith(nonce):
            continue
        try:
            obj = json.loads(line[len(nonce) :])
        except ValueError:
            continue
        if "setup" in obj:
            setup = obj
        elif isinstance(obj.get("i"), int):
            reported[obj["i"]] = obj
    out = []
    for i, t in enumerate(tests):
        if setup is not None and setup["setup"] != "ok":
            out.append({"test": t, "passed": False, "status": setup["setup"], "stderr": setup["stderr"]})
        elif i in reported:
            r = reported[i]
            out.append({"test": t, "passed": r["status"] == "ok", "status": r["status"], "stderr": r["stderr"]})
        else:  # the run died before reporting this test: blame the sandbox outcome
            status = res.status if res.status != "ok" else "not_run"
            out.append({"test": t, "passed": False, "status": status, "stderr": _tail(res.stderr)})
    return out


def run_io_cases(code: str, cases: list[dict], pool: SandboxPool) -> list[dict]:
    futs = [pool.submit(code, stdin=str(c.get("stdin", ""))) for c in cases]
    out = []
    for c, f in zip(cases, futs):
        r = f.result()
        expected = str(c.get("stdout", c.get("output", "")))
        if r.status != "ok":
            passed, status = False, r.status
        else:
            passed = _norm(r.stdout) == _norm(expected)
            status = "ok" if passed else "wrong_answer"
        out.append(
            {
                "stdin": _tail(str(c.get("stdin", "")), 200),
                "passed": passed,
                "status": status,
                "stderr": _tail(r.stderr),
                "stdout": _tail(r.stdout, 200),
            }
        )
    return out


_default_lock = threading.Lock()
_default_pool: SandboxPool | None = None


def default_pool() -> SandboxPool:
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SandboxPool(SandboxConfig(timeout_s=10), max_concurrency=4)
        return _default_pool


def score_code(
    response: str,
    tests: list[str] | None = None,
    cases: list[dict] | None = None,
    pool: SandboxPool | None = None,
    per_test_s: float = 2.0,
) -> dict[str, Any]:
    pool = pool or default_pool()
    code = extract_code(response)
    tests, cases = list(tests or []), list(cases or [])
    results: list[dict] = []
    if not pool.sandbox.available():
        results = [{"passed": False, "status": "sandbox_unavailable", "stderr": ""}] * (len(tests) + len(cases))
        err = pool.sandbox._probe()
        return {"reward": 0.0, "passed": 0, "total": len(results), "results": results, "error": err}
    if tests:
        results += run_assert_tests(code, tests, pool.sandbox, per_test_s)
    if cases:
        results += run_io_cases(code, cases, pool)
    passed = sum(r["passed"] for r in results)
    total = len(results)
    return {"reward": passed / total if total else 0.0, "passed": passed, "total": total, "results": results}


def _problem_from(label: Any, metadata: dict | None) -> tuple[list, list]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except ValueError:
            label = None
    if isinstance(label, list):
        label = {"tests": label}
    source = label if isinstance(label, dict) and (label.get("tests") or label.get("cases")) else (metadata or {})
    return _checked_problem(source.get("tests") or [], source.get("cases") or [])


def _checked_problem(tests: Any, cases: Any) -> tuple[list, list]:
    """tests: a list of assert statements (one string: one test); cases: a list of {stdin, stdout}."""
    tests = [tests] if isinstance(tests, str) else tests  # iterated, a string was one test per character
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"code_reward: 'tests' must be a list of assert statements (strings), got {tests!r:.100}")
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
        raise ValueError(f"code_reward: 'cases' must be a list of {{'stdin', 'stdout'}} dicts, got {cases!r:.100}")
    return tests, cases


def code_reward(prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
    tests, cases = _problem_from(label, metadata)
    detail = score_code(response, tests, cases)
    if isinstance(metadata, dict):
        metadata["code_reward"] = detail
    return float(detail["reward"])
