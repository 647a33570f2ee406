"""A software-engineering agent environment (the env contract of envs/contract.py): fix the bug
planted in a small Python repository until its unittest suite passes.

Task (the sample's `metadata["label"]`): {"task_id": str, "files": {path: text}, "test_files":
[paths under tests/]}; envs/swe_tasks.py generates them (examples/data/swe_tasks.jsonl).

Tools, called Qwen-style, several per turn (up to `max_calls_per_turn`); `arguments` may also be
a JSON string (OpenAI style):

    <tool_call>{"name": "read_file", "arguments": {"path": "pkg/mod.py", "start_line": 1, "end_line": 40}}</tool_call>

    list_dir(path=".")                       files and directories under path, sorted
    read_file(path, start_line=1, end_line=None)   numbered lines, at most `max_read_lines`
    write_file(path, content)                create or overwrite (not under tests/)
    apply_patch(patch)                       a unified diff, applied strictly and all or nothing
    run_tests()                              the whole suite in the sandbox: counts and failures
    finish()                                 runs the suite, ends the episode with the reward

Each result comes back as `<tool_response>\\n...\\n</tool_response>` (an error as `error: ...`);
`chat_format="qwen"` wraps the responses in a Qwen user turn and opens the assistant's next one.

The workspace is an in-memory dict, path -> text (envs/swe_workspace.py): the file tools only
ever change dict entries, so they have no filesystem to escape from, and the model's code never
runs in this process. Code runs only in the bwrap sandbox: `run_tests` and `finish` write the
workspace into the sandbox's fresh `/work` (with the task's original tests, whatever the
workspace holds) and run a fixed runner script there (envs/swe_runner.py, which also describes
how the report is protected against forgery and where that protection ends).

Reward, at `finish` only (every other step gives 0): 1.0 when every test passes; otherwise the
share of the tests that failed at the start which now pass, minus the tests newly broken (as a
share of the same), clipped to [0, 0.99]; so finishing at once gives 0. The failing-at-start set
is computed at runtime, once per episode, by running the original repository: from the first
`run_tests` or `finish` while the workspace is still unchanged (no extra run), else at `finish`.

Misbehaviour ends the episode (done, reward 0, `info["end_reason"]`, details in
`info["end_detail"]`): `path_outside_workspace` (an absolute path or `..` in any tool),
`sandbox_timeout` / `sandbox_output_limit` / `sandbox_memory` / `sandbox_killed` (a test run that
hit that limit: an infinite loop, an output flood), `loop` (the same call, name and arguments,
`max_repeated_calls` times in a row). A malformed call (bad JSON, a number too long, nesting too
deep, text that is not UTF-8: envs/model_text.py), an unknown tool, a bad argument, a patch that
does not apply, or any other exception a file tool raises (named with its type) is an error
result, and the episode goes on. `finish` ends it with `end_reason="finish"`.

Snapshot/restore: `snapshot()` is the whole state after the last step as JSON-safe data (changed
files, call history, repeat counter, failing-at-start set, turn count); `restore(sample, snap)`
after `reset(sample)` makes an env that behaves exactly like the one that took the snapshot, so an
aborted episode resumes without replaying its tool calls.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envs import model_text
from envs.sandbox import MAIN_FILE, Sandbox, SandboxConfig
from envs.swe_runner import SuiteRun, run_suite
from envs.swe_workspace import PathOutsideWorkspace, ToolError, Workspace, normalize_path
from slime.sample import Sample
from slime.security import printable_excerpt

logger = logging.getLogger(__name__)
TESTS_DIR = "tests"
MAX_SHOWN_FAILURES = 5
MAX_SHOWN_TRACEBACK = 600
MAX_PARTIAL_REWARD = 0.99
CALL_FORMAT = (
    'call a tool as <tool_call>{"name": "read_file", "arguments": {"path": "pkg/mod.py"}}</tool_call>; '
    "tools: list_dir(path), read_file(path, start_line, end_line), write_file(path, content), "
    "apply_patch(patch), run_tests(), finish()"
)


def _explain(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


class SweEnvConfig(BaseModel):
    """`env.kwargs` of SweEnv."""

    model_config = ConfigDict(extra="forbid")

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="where run_tests/finish run")
    max_calls_per_turn: int = Field(4, ge=1)
    max_read_lines: int = Field(80, ge=1, description="lines one read_file call shows")
    max_observation_chars: int = Field(4000, ge=200, description="all tool results of one turn together")
    max_workspace_bytes: int = Field(512 * 1024, ge=1024)
    max_files: int = Field(200, ge=1)
    max_repeated_calls: int = Field(4, ge=2, description="this many identical calls in a row end the episode")
    chat_format: Literal["plain", "qwen"] = "plain"


class TaskLabel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    task_id: str = Field(min_length=1)
    files: dict[str, str] = Field(min_length=1)
    test_files: list[str] = Field(min_length=1)

    @field_validator("files")
    @classmethod
    def _paths_are_clean(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            if normalize_path(path) != path or path == MAIN_FILE:
                raise ValueError(f"{path!r} is not a clean relative path")
        return files

    @model_validator(mode="after")
    def _tests_exist(self) -> TaskLabel:
        for path in self.test_files:
            if path not in self.files or not path.startswith(TESTS_DIR + "/") or not path.endswith(".py"):
                raise ValueError(f"test file {path!r} must be a .py file under {TESTS_DIR}/ listed in files")
        return self


# ---- tool calls ----------------------------------------------------------------------------------
class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListDirArgs(_Args):
    path: str = "."


class ReadFileArgs(_Args):
    path: str
    start_line: int = Field(1, ge=1)
    end_line: int | None = Field(None, ge=1)


class WriteFileArgs(_Args):
    path: str
    content: str


class ApplyPatchArgs(_Args):
    patch: str


TOOLS: dict[str, tuple[type[_Args], str]] = {
    "list_dir": (ListDirArgs, 'list_dir(path=".")'),
    "read_file": (ReadFileArgs, "read_file(path, start_line=1, end_line=null)"),
    "write_file": (WriteFileArgs, "write_file(path, content)"),
    "apply_patch": (ApplyPatchArgs, "apply_patch(patch)"),
    "run_tests": (_Args, "run_tests()"),
    "finish": (_Args, "finish()"),
}


@dataclass
class ToolCall:
    name: str | None
    arguments: dict[str, Any]
    key: str  # what the repeat check compares: a hash of name and arguments (or of the raw text)
    error: str | None = None  # why it cannot be run at all


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls = [_parse_call(m.group(1)) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if "<tool_call>" in rest:
        calls.append(ToolCall(None, {}, _digest(rest), "<tool_call> is never closed; end it with </tool_call>"))
    return calls


def _parse_call(body: str) -> ToolCall:
    raw = body.strip()
    try:
        obj = model_text.loads(raw)
    except RecursionError:
        return ToolCall(None, {}, _digest(raw), f"the tool call is {model_text.NESTED_TOO_DEEPLY}")
    except ValueError as exc:
        return ToolCall(None, {}, _digest(raw), f"malformed JSON in <tool_call>: {exc}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, _digest(raw), 'a call is a JSON object {"name": TOOL, "arguments": {...}}')
    name = obj["name"]
    if not model_text.is_text(name):
        return ToolCall(None, {}, _digest(raw), f"the tool name is {model_text.NOT_TEXT}")
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = model_text.loads(arguments) if arguments.strip() else {}
        except RecursionError:
            return ToolCall(name, {}, _digest(raw), f"{name}: arguments are {model_text.NESTED_TOO_DEEPLY}")
        except ValueError as exc:
            return ToolCall(name, {}, _digest(raw), f"{name}: arguments are not JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, _digest(raw), f"{name}: arguments must be a JSON object")
    if not model_text.is_text(arguments):  # every file tool encodes what it is given (sizes, the sandbox)
        return ToolCall(name, {}, _digest(raw), f"{name}: arguments are {model_text.NOT_TEXT}")
    return ToolCall(name, arguments, _digest(json.dumps([name, arguments], sort_keys=True)))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]  # the model's raw text


def _short(arguments: dict[str, Any]) -> dict[str, Any]:
    """Arguments as kept in the history: long texts (patches, file contents) by their size."""
    out = {}
    for name, value in arguments.items():
        text = json.dumps(value)
        out[name] = value if len(text) <= 80 else f"<{len(text)} characters>"
    return out


# ---- snapshot ------------------------------------------------------------------------------------
class HistoryEntry(BaseModel):
    name: str | None
    args: dict[str, Any]
    ok: bool


class Baseline(BaseModel):
    tests: list[str]  # every test of the original repository
    failing: list[str]  # those that fail there


class SweSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    task_id: str
    changed: dict[str, str | None]  # path -> text, None for a deleted file
    history: list[HistoryEntry]
    last_call_key: str | None
    repeat_count: int = Field(ge=0)
    baseline: Baseline | None
    turns: int = Field(ge=0)
    done: bool
    end_reason: str | None


# ---- the env -------------------------------------------------------------------------------------
class SweEnv:
    def __init__(self, **kwargs: Any):
        try:
            self.cfg = SweEnvConfig(**kwargs)
        except ValidationError as exc:
            raise ValueError(f"SweEnv kwargs (env.kwargs): {_explain(exc)}") from None
        self.sandbox = Sandbox(self.cfg.sandbox)
        self.task: TaskLabel | None = None
        self.workspace: Workspace | None = None
        self._clear()

    def _clear(self) -> None:
        self.history: list[HistoryEntry] = []
        self.last_call_key: str | None = None
        self.repeat_count = 0
        self.baseline: Baseline | None = None
        self.turns = 0
        self.done = False
        self.end_reason: str | None = None
        self.end_detail: str | None = None

    # ---- contract --------------------------------------------------------------------------------
    def reset(self, sample: Sample) -> str:
        self.task = self._task_of(sample)
        self.workspace = Workspace(
            dict(self.task.files),
            self.cfg.max_workspace_bytes,
            self.cfg.max_files,
            protected=(TESTS_DIR,),
            reserved=frozenset({MAIN_FILE}),
        )
        self._clear()
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.task is None or self.done:
            raise RuntimeError("SweEnv.step: call reset first; a finished episode takes no more steps")
        self.turns += 1
        calls = parse_tool_calls(action)
        if not calls:
            return (
                self._observation([f"error: no tool call found; {CALL_FORMAT}"]),
                0.0,
                False,
                {"calls": [], "errors": 1},
            )
        bodies: list[str] = []
        reward = 0.0
        errors = 0
        run: SuiteRun | None = None
        for call in calls[: self.cfg.max_calls_per_turn]:
            body, ok, reward, run = self._handle(call)
            bodies.append(body if ok else f"error: {body}")
            errors += not ok
            if self.done:
                break
        skipped = len(calls) - self.cfg.max_calls_per_turn
        if skipped > 0 and not self.done:
            bodies.append(f"error: at most {self.cfg.max_calls_per_turn} tool calls per turn; {skipped} skipped")
        info: dict[str, Any] = {"calls": [c.name for c in calls], "errors": errors}
        if self.done:
            info.update(end_reason=self.end_reason, end_detail=self.end_detail)
            if run is not None and self.end_reason == "finish":
                info.update(tests_passed=len(run.passed), tests_total=len(self.baseline.tests))
        return self._observation(bodies), reward, self.done, info

    # ---- one call --------------------------------------------------------------------------------
    def _handle(self, call: ToolCall) -> tuple[str, bool, float, SuiteRun | None]:
        """(result text, ok, reward, the suite run if one was made)."""
        self.repeat_count = self.repeat_count + 1 if call.key == self.last_call_key else 1
        self.last_call_key = call.key
        entry = HistoryEntry(name=call.name, args=_short(call.arguments), ok=False)
        self.history.append(entry)
        if self.repeat_count >= self.cfg.max_repeated_calls:
            self._end("loop", f"the same {call.name or 'malformed'} call {self.repeat_count} times in a row")
            return self.end_detail, False, 0.0, None
        if call.error is not None:
            return call.error, False, 0.0, None
        if call.name not in TOOLS:
            return f"unknown tool {call.name!r}; {CALL_FORMAT}", False, 0.0, None
        model, usage = TOOLS[call.name]
        try:
            args = model.model_validate(call.arguments)
        except ValidationError as exc:
            return f"{call.name}: {_argument_errors(exc)}; usage: {usage}", False, 0.0, None
        try:
            body, reward, run = self._run_tool(call.name, args)
        except PathOutsideWorkspace as exc:
            self._end("path_outside_workspace", f"{call.name}: {exc}")
            return self.end_detail, False, 0.0, None
        except ToolError as exc:
            return f"{call.name}: {exc}", False, 0.0, None
        entry.ok = not self.done or self.end_reason == "finish"  # a test run that hit a sandbox limit
        return body, entry.ok, reward, run

    def _run_tool(self, name: str, args: _Args) -> tuple[str, float, SuiteRun | None]:
        if name not in ("run_tests", "finish"):
            try:  # a file tool changes the workspace all or nothing (Workspace.commit)
                return self._file_tool(args), 0.0, None
            except ToolError:
                raise
            except Exception as exc:  # the tool's own failure on what the model sent: an error result
                logger.warning("SweEnv tool %s raised on the model's call", name, exc_info=True)
                raise ToolError(f"the tool failed ({type(exc).__name__}: {printable_excerpt(str(exc), 200)})") from exc
        run = self._run_suite()
        if run.hit_limit is not None:
            self._end(f"sandbox_{run.hit_limit}", f"{name}: the test run hit the sandbox's {run.hit_limit} limit")
            return self.end_detail, 0.0, run
        if name == "run_tests":
            return describe_run(run), 0.0, run
        reward = self._reward(run)
        self._end("finish", f"finished with reward {reward:.3f}")
        return f"{describe_run(run)}\nepisode finished; reward {reward:.3f}", reward, run

    def _file_tool(self, args: _Args) -> str:
        ws = self.workspace
        if isinstance(args, ListDirArgs):
            return ws.list_dir(args.path)
        if isinstance(args, ReadFileArgs):
            return ws.read_file(args.path, args.start_line, args.end_line, self.cfg.max_read_lines)
        if isinstance(args, WriteFileArgs):
            return ws.write_file(args.path, args.content)
        if isinstance(args, ApplyPatchArgs):
            return ws.apply_patch(args.patch)
        raise TypeError(f"no file tool takes {type(args).__name__}")

    def _end(self, reason: str, detail: str) -> None:
        self.done, self.end_reason, self.end_detail = True, reason, detail

    # ---- tests and reward ------------------------------------------------------------------------
    def _sandbox_files(self, files: dict[str, str]) -> dict[str, str]:
        """The workspace's files with the task's original tests, whatever the workspace holds."""
        originals = {p: t for p, t in self.task.files.items() if p.startswith(TESTS_DIR + "/")}
        kept = {p: t for p, t in files.items() if not p.startswith(TESTS_DIR + "/")}
        return {**kept, **originals}

    def _run_suite(self) -> SuiteRun:
        run = run_suite(self.sandbox, self._sandbox_files(self.workspace.files), self.task.test_files)
        if self.baseline is None and not self.changed_files() and run.complete and run.hit_limit is None:
            self.baseline = Baseline(tests=sorted(run.outcomes), failing=run.not_passed)
        return run

    def _ensure_baseline(self) -> Baseline:
        if self.baseline is None:
            run = run_suite(self.sandbox, self._sandbox_files(self.task.files), self.task.test_files)
            if not run.complete or run.hit_limit is not None:
                raise RuntimeError(
                    f"task {self.task.task_id}: the original repository's tests did not run to the end "
                    f"(sandbox status {run.sandbox_status}); the task is broken"
                )
            self.baseline = Baseline(tests=sorted(run.outcomes), failing=run.not_passed)
        return self.baseline

    def _reward(self, run: SuiteRun) -> float:
        baseline = self._ensure_baseline()
        passed = run.passed
        if run.complete and all(t in passed for t in baseline.tests):
            return 1.0
        if not baseline.failing:
            return 0.0
        fixed = sum(t in passed for t in baseline.failing)
        broken = sum(t not in passed for t in baseline.tests if t not in baseline.failing)
        return min(max((fixed - broken) / len(baseline.failing), 0.0), MAX_PARTIAL_REWARD)

    # ---- observations ----------------------------------------------------------------------------
    def _observation(self, bodies: list[str]) -> str:
        budget = self.cfg.max_observation_chars // max(len(bodies), 1)
        text = "\n".join(f"<tool_response>\n{_cap(body, budget)}\n</tool_response>" for body in bodies)
        if self.cfg.chat_format == "qwen":
            return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return text + "\n"

    # ---- snapshot / restore ----------------------------------------------------------------------
    def changed_files(self) -> dict[str, str | None]:
        """Files that differ from the task's: path -> text, None for a deleted one."""
        original, now = self.task.files, self.workspace.files
        changed: dict[str, str | None] = {p: t for p, t in now.items() if original.get(p) != t}
        changed.update({p: None for p in original if p not in now})
        return dict(sorted(changed.items()))

    def snapshot(self) -> dict[str, Any]:
        if self.task is None:
            raise RuntimeError("SweEnv.snapshot: call reset first")
        return SweSnapshot(
            task_id=self.task.task_id,
            changed=self.changed_files(),
            history=self.history,
            last_call_key=self.last_call_key,
            repeat_count=self.repeat_count,
            baseline=self.baseline,
            turns=self.turns,
            done=self.done,
            end_reason=self.end_reason,
        ).model_dump(mode="json")

    def restore(self, sample: Sample, snapshot: dict[str, Any]) -> None:
        """Called after reset(sample): continue from `snapshot` as the env that took it would."""
        if self.task is None or self._task_of(sample).task_id != self.task.task_id:
            raise RuntimeError("SweEnv.restore: call reset(sample) with the snapshot's sample first")
        try:
            snap = SweSnapshot.model_validate(snapshot)
        except ValidationError as exc:
            raise ValueError(f"SweEnv.restore: not a snapshot of SweEnv: {_explain(exc)}") from None
        if snap.task_id != self.task.task_id:
            raise ValueError(f"SweEnv.restore: the snapshot is of task {snap.task_id}, not {self.task.task_id}")
        try:
            changes = {normalize_path(p): t for p, t in snap.changed.items()}
            if any(p.startswith(TESTS_DIR + "/") or p == MAIN_FILE for p in changes):
                raise ToolError("it changes the tests or a reserved file")
            self.workspace.commit(changes)
        except ToolError as exc:
            raise ValueError(f"SweEnv.restore: the snapshot's files cannot be restored: {exc}") from None
        self.history = list(snap.history)
        self.last_call_key, self.repeat_count = snap.last_call_key, snap.repeat_count
        self.baseline, self.turns = snap.baseline, snap.turns
        self.done, self.end_reason = snap.done, snap.end_reason

    # ---- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _task_of(sample: Sample) -> TaskLabel:
        label = sample.metadata.get("label")
        if not isinstance(label, dict):
            raise ValueError(
                f"sample {sample.id}: metadata['label'] must be a dict with task_id, files and test_files, "
                f"got {type(label).__name__}"
            )
        try:
            return TaskLabel.model_validate(label)
        except ValidationError as exc:
            raise ValueError(f"sample {sample.id}: label.{_explain(exc)}") from None


def _argument_errors(exc: ValidationError) -> str:
    out = []
    for e in exc.errors():
        name = ".".join(str(p) for p in e["loc"])
        if e["type"] == "missing":
            out.append(f'missing argument "{name}"')
        elif e["type"] == "extra_forbidden":
            out.append(f'unknown argument "{name}"')
        else:
            out.append(f'argument "{name}": {e["msg"]}')
    return "; ".join(out)


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} more characters cut]"
    return text[: max(limit - len(marker), 0)] + marker


def describe_run(run: SuiteRun) -> str:
    """The result of a test run as the model sees it: counts, then each failure with its traceback."""
    load_errors = run.load_errors
    statuses = [status for test, status in run.outcomes.items() if test not in load_errors]
    errors = statuses.count("error") + statuses.count("memory")
    counts = f"{statuses.count('passed')} passed, {statuses.count('failed')} failed, {errors} errors"
    lines = [
        f"ran {len(statuses)} tests: {counts}"
        + (f", {statuses.count('skipped')} skipped" if "skipped" in statuses else "")
    ]
    if load_errors:
        lines.append(f"could not load: {', '.join(load_errors)} (their tests count as failed)")
    if run.tampered:
        lines.append(
            f"the run is void, every test counts as failed: {run.tampered} (code under test must not "
            "change unittest, builtins, json or the import machinery)"
        )
    if not run.complete:
        lines.append(f"the test run ended early (exit code {run.exit_code}); tests that did not report count as failed")
        if run.stderr_tail.strip():
            lines.append(_tail(run.stderr_tail.strip(), MAX_SHOWN_TRACEBACK))
    failures = run.not_passed
    for test_id in failures[:MAX_SHOWN_FAILURES]:
        lines.append(f"{run.outcomes[test_id].upper()}: {test_id}")
        if test_id in run.tracebacks:
            lines.append(_tail(run.tracebacks[test_id].rstrip(), MAX_SHOWN_TRACEBACK))
    if len(failures) > MAX_SHOWN_FAILURES:
        lines.append(f"... and {len(failures) - MAX_SHOWN_FAILURES} more: {', '.join(failures[MAX_SHOWN_FAILURES:])}")
    return "\n".join(lines)


def _tail(text: str, limit: int) -> str:
    """The last `limit` characters, from a line start."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return "..." + cut[cut.find("\n") :] if "\n" in cut else "..." + cut
