"""Running a task's unittest suite in the sandbox, for the software-engineering env (envs/swe.py).

`run_suite(sandbox, files, test_files)` writes `files` (the workspace, with the task's original
tests) into the sandbox's `/work` and runs `RUNNER` there as the sandbox's main script (a name the
workspace may not use). The runner loads each test file by its path, runs it with unittest and
reports one JSON line per test: `{"id": "tests.test_x.TestY.test_z", "status": "passed" | "failed"
| "error" | "skipped" | "memory", "tb": "..."}`, then `{"done": true, "tampered": null}`.

Against a forged report (the workspace's code runs in the same interpreter as the runner):

* each report line starts with a random nonce the runner reads from stdin before any workspace
  code is imported; stdin is then pointed at /dev/null, and lines are written to a duplicate of
  the stdout fd taken at that moment, so printing (or closing stdout) cannot make or stop a line;
* a run without the final `done` line (os._exit, a crash) is incomplete: its unreported tests count
  as not passed;
* the runner checks at the end that unittest's modules and classes, builtins, json's encoder, the
  import hooks and its own result class are the objects they were before the workspace's code ran,
  and that no trace or profile function is set; a change is reported as `tampered` and the run
  counts as all failed.

Limits: the code under test shares the interpreter with the runner. Code written to attack it can
find the nonce and the fd (gc, frame introspection, /proc/self/fd), patch what the runner does not
watch (the test module's own objects, e.g. from a thread or an import-time frame hack, or the
runner function's `__code__`), or tamper and restore between checks. The nonce stops accidental or
naive forgery, not a determined adversary; for that the suite would have to run in a process the
workspace's code never enters, with results checked from outside.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from envs.sandbox import Sandbox

MAX_TRACEBACK_CHARS = 800
MAX_TRACEBACKS = 20  # per run: a suite where everything fails reports the first ones in full

RUNNER = r"""
import sys
# sys.path[0] is /work, the workspace: a workspace json.py (or unittest/, traceback.py, ...) would
# be imported in place of the stdlib below, before the nonce is read. Out until _main has read it.
_WORK = sys.path.pop(0)
import builtins, importlib.util, json, json.encoder, os, traceback, unittest
import unittest.case, unittest.loader, unittest.result, unittest.suite, unittest.util


def _read_stdin():
    data = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce, test_files = data.decode().split("\n", 1)
    return nonce, json.loads(test_files)


def _state(own_classes):
    # Modules: each attribute's object (new attributes are allowed: importing a submodule adds one);
    # classes and import hooks: every attribute, none added.
    modules = [builtins, json, json.encoder, unittest, unittest.case, unittest.loader, unittest.result,
               unittest.suite, unittest.util]
    fixed = {"sys.meta_path": dict(enumerate(sys.meta_path)), "sys.path_hooks": dict(enumerate(sys.path_hooks))}
    for module in modules[1:]:
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__.startswith(("unittest", "json")):
                fixed[module.__name__ + "." + name] = dict(vars(value))
    for cls in own_classes:
        fixed[cls.__name__] = dict(vars(cls))
    return {m.__name__: dict(vars(m)) for m in modules}, fixed


def _tampered(before, own_classes):
    (modules, fixed), (modules_now, fixed_now) = before, _state(own_classes)
    for where, names in [*modules.items(), *fixed.items()]:
        now = modules_now.get(where) or fixed_now[where]
        for name, value in names.items():
            if now.get(name, now) is not value:
                return where + "." + str(name) + " was changed"
    for where, names in fixed.items():
        added = sorted(set(fixed_now[where]) - set(names), key=str)
        if added:
            return where + "." + str(added[0]) + " was added"
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return "a trace or profile function was set"
    return None


class _Result(unittest.TestResult):
    def __init__(self, report, tracebacks):
        super().__init__()
        self._send_report = report
        self._tracebacks_left = tracebacks

    def _send(self, test, status, err=None):
        entry = {"id": test.id(), "status": status}
        if err is not None and self._tracebacks_left > 0:
            self._tracebacks_left -= 1
            entry["tb"] = self._exc_info_to_string(err, test)[-MAX_TB:]
        self._send_report(entry)

    def addSuccess(self, test):
        self._send(test, "passed")

    def addFailure(self, test, err):
        self._send(test, "failed", err)

    def addError(self, test, err):
        self._send(test, "memory" if issubclass(err[0], MemoryError) else "error", err)

    def addSkip(self, test, reason):
        self._send(test, "skipped")

    def addExpectedFailure(self, test, err):
        self._send(test, "failed")

    def addUnexpectedSuccess(self, test):
        self._send(test, "failed")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._send(test, "failed" if failed else "error", err)


def _load_error(format_exception):
    # The traceback from the first frame of the workspace's code on (not the runner's, not importlib's).
    kind, value, tb = sys.exc_info()
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<string>")
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen")):
        tb = tb.tb_next
    return "".join(format_exception(kind, value, tb))[-MAX_TB:]


def _main():
    nonce, test_files = _read_stdin()
    out_fd = os.dup(1)
    sys.path.insert(0, _WORK)  # the tests import the workspace's packages
    dumps, write, format_exception = json.dumps, os.write, traceback.format_exception
    check, result_class, load_error = _tampered, _Result, _load_error

    def report(entry):
        write(out_fd, ("\n" + nonce + dumps(entry) + "\n").encode())

    before = _state([result_class])
    result = result_class(report, MAX_TRACEBACKS)
    suites = []
    for path in test_files:
        name = path[:-3].replace("/", ".")
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            suites.append(unittest.defaultTestLoader.loadTestsFromModule(module))
        except BaseException:  # SystemExit and KeyboardInterrupt too: the report must go on
            report({"id": path, "status": "error", "tb": load_error(format_exception)})
    for suite in suites:
        try:
            suite.run(result)
        except BaseException:
            report({"id": "suite", "status": "error", "tb": load_error(format_exception)})
    report({"done": True, "tampered": check(before, [result_class])})


_main()
"""


@dataclass
class SuiteRun:
    """One run of the suite: the sandbox's status and, per test id, its outcome."""

    sandbox_status: str  # SandboxResult.status: ok, error, timeout, memory, output_limit, ...
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/error/skipped/memory
    tracebacks: dict[str, str] = field(default_factory=dict)
    complete: bool = False  # the runner reported its final line
    tampered: str | None = None
    exit_code: int | None = None
    stderr_tail: str = ""

    @property
    def passed(self) -> set[str]:
        return {t for t, status in self.outcomes.items() if status == "passed"}

    @property
    def not_passed(self) -> list[str]:
        return sorted(t for t, status in self.outcomes.items() if status != "passed")

    @property
    def load_errors(self) -> list[str]:
        """Test files that could not be imported (their id is the path), or "suite" when running broke."""
        return sorted(t for t in self.outcomes if t.endswith(".py") or t == "suite")

    @property
    def hit_limit(self) -> str | None:
        """The sandbox limit the run hit (the env ends the episode), or None."""
        if self.sandbox_status in ("timeout", "memory", "output_limit", "killed"):
            return self.sandbox_status
        if "memory" in self.outcomes.values():
            return "memory"
        return None


def run_suite(sandbox: Sandbox, files: dict[str, str], test_files: list[str]) -> SuiteRun:
    nonce = secrets.token_hex(16)
    code = f"MAX_TB = {MAX_TRACEBACK_CHARS}\nMAX_TRACEBACKS = {MAX_TRACEBACKS}\n{RUNNER}"
    result = sandbox.run_python(code, stdin=nonce + "\n" + json.dumps(test_files), files=files)
    if result.status == "sandbox_unavailable":
        raise RuntimeError(f"the sandbox cannot run the tests: {result.error}")
    run = SuiteRun(result.status, exit_code=result.exit_code, stderr_tail=result.stderr[-600:])
    for line in result.stdout.split("\n"):
        at = line.find(nonce)
        if at < 0:
            continue
        try:
            entry = json.loads(line[at + len(nonce) :])
        except ValueError:
            continue
        if entry.get("done"):
            run.complete = True
            run.tampered = entry.get("tampered")
            continue
        test_id, status = str(entry.get("id")), str(entry.get("status"))
        if run.outcomes.get(test_id, "passed") == "passed":  # a subtest's failure outranks the pass
            run.outcomes[test_id] = status
            if "tb" in entry:
                run.tracebacks[test_id] = str(entry["tb"])
    if run.tampered:
        run.outcomes = {t: "error" for t in run.outcomes}
    return run
