"""A malformed or failing tool call from the model never fails the episode (ToolEnv, SweEnv): it is
answered with an error observation and the episode goes on. Each case here once escaped `env.step`
(found by fuzzing): a number of thousands of digits, a lone UTF-16 surrogate, JSON nested past the
recursion limit, a tool raising something of its own. And sandbox settings that cannot work are
refused when the env is built, naming the setting, instead of making every run fail.

None of these runs code in the sandbox: the calls are refused before a run, the settings at
construction."""

from __future__ import annotations

import json
import re

import pytest

from envs.agent import ToolEnv
from envs.sandbox import Sandbox, SandboxConfig, SandboxPool
from envs.swe import SweEnv
from envs.swe_tasks import tool_call
from envs.swe_workspace import ToolError, Workspace
from envs.tools import Tool
from slime.errors import UserError
from slime.sample import Sample

LONG_NUMBER = "1" + "0" * 5000
NOT_TEXT = "arguments are not valid UTF-8 text (a lone surrogate)"
LABEL = {
    "task_id": "toy",
    "files": {
        "calc/__init__.py": "",
        "calc/ops.py": "def add(a, b):\n    return a - b\n",
        "tests/test_ops.py": "import unittest\n\nfrom calc.ops import add\n\n\n"
        "class TestOps(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    },
    "test_files": ["tests/test_ops.py"],
}


def sample_of(label: object) -> Sample:
    return Sample(group_id="g", index=0, prompt_ids=[1], max_new_tokens=8, metadata={"label": label})


def tool_env() -> ToolEnv:
    env = ToolEnv(tools=["calculator", "python"])  # the python tool's sandbox is only probed when it runs
    env.reset(sample_of("5"))
    return env


def swe_env() -> SweEnv:
    env = SweEnv()
    env.reset(sample_of(LABEL))
    return env


def observation_of(result: tuple[str, float, bool, dict]) -> str:
    """The observation of a step that went on; it must be text the worker can tokenise."""
    observation, reward, done, info = result
    assert not done and reward == 0.0 and info["errors"] >= 1, result
    observation.encode("utf-8")
    return observation


# ---- 1: a number of thousands of digits ----------------------------------------------------------
@pytest.mark.parametrize(
    "action",
    [
        '{"tool": "calculator", "args": ' + LONG_NUMBER + "}",  # json's int() raised a bare ValueError: no .msg
        '<tool_call>{"name": "calculator", "arguments": {"expression": ' + LONG_NUMBER + "}}</tool_call>",
        '{"tool": "python", "args": -' + LONG_NUMBER + "}",
    ],
)
def test_tool_env_a_number_too_long_is_an_error_observation(action):
    observation = observation_of(tool_env().step(action))
    assert "<error>malformed JSON tool call: the number is too long (5001 digits" in observation


def test_tool_env_a_long_number_as_a_string_is_refused_by_the_calculator():
    observation = observation_of(tool_env().step(json.dumps({"tool": "calculator", "args": LONG_NUMBER})))
    assert observation == "<error>calculator: expression longer than 200 characters</error>\n"


def test_swe_env_a_number_too_long_is_an_error_result():
    action = '<tool_call>{"name": "read_file", "arguments": {"path": "calc/ops.py", "start_line": '
    observation = observation_of(swe_env().step(action + LONG_NUMBER + "}}</tool_call>"))
    assert "error: malformed JSON in <tool_call>: the number is too long (5001 digits" in observation


# ---- 2: a lone surrogate (JSON's \ud800 escape, or in the text itself) ----------------------------
@pytest.mark.parametrize(
    "action, tool",
    [
        ('{"tool": "calculator", "args": "1+\\ud800"}', "calculator"),  # ast.parse raised UnicodeEncodeError
        ("<calculator>1+\ud800</calculator>", "calculator"),
        ('{"tool": "calculator", "args": "{\\"expression\\": \\"\\ud800\\"}"}', "calculator"),
        ('{"tool": "python", "args": "print(\'\\ud800\')"}', "python"),  # writing the sandbox's file raised
        ('<tool_call>{"name": "python", "arguments": {"code": "\\ud800"}}</tool_call>', "python"),
    ],
)
def test_tool_env_a_lone_surrogate_is_an_error_observation(action, tool):
    observation = observation_of(tool_env().step(action))
    assert f"<error>{tool}: {NOT_TEXT}</error>" in observation


def test_tool_env_a_lone_surrogate_never_reaches_the_observation():
    # An unknown tool name was echoed as it was: an observation the tokenizer cannot encode.
    observation = observation_of(tool_env().step('{"tool": "\\ud800", "args": []}'))
    assert observation == '<error>the "tool" field is not valid UTF-8 text (a lone surrogate)</error>\n'


def test_tool_env_a_tool_that_raises_is_an_error_naming_the_tool_and_the_exception():
    env = tool_env()

    def broken(argument: str) -> str:
        raise KeyError("kaput")

    env.registry.add(Tool("broken", "x", broken, "raises"))
    observation, reward, done, info = env.step("<broken>1</broken> <calculator>2+3</calculator>")
    assert not done and info == {"calls": ["broken", "calculator"], "errors": 1}
    assert observation == (
        "<error>broken: the tool failed (KeyError: 'kaput')</error>\n<result name=\"calculator\">5</result>\n"
    )


# ---- 3: SweEnv: a lone surrogate in a file tool's arguments --------------------------------------
@pytest.mark.parametrize(
    "action, tool",
    [
        (tool_call("write_file", path="calc/new.py", content="\ud800"), "write_file"),  # total_bytes raised
        (tool_call("write_file", path="calc/\ud800.py", content="x = 1\n"), "write_file"),
        (tool_call("read_file", path="\ud800"), "read_file"),  # echoed in "no such file: ..."
        (tool_call("apply_patch", patch="--- /dev/null\n+++ b/calc/new.py\n@@ -0,0 +1 @@\n+\ud800\n"), "apply_patch"),
        (tool_call("write_file", path="calc/new.py", content={"nested": ["\ud800"]}), "write_file"),
    ],
)
def test_swe_env_a_lone_surrogate_is_an_error_result_and_changes_nothing(action, tool):
    env = swe_env()
    observation = observation_of(env.step(action))
    assert f"error: {tool}: {NOT_TEXT}" in observation
    assert env.workspace.files == LABEL["files"]
    json.dumps(env.snapshot(), ensure_ascii=False).encode("utf-8")  # the snapshot stays storable


def test_swe_env_a_lone_surrogate_outside_json_is_a_malformed_call():
    observation = observation_of(swe_env().step("<tool_call>\ud800</tool_call>"))  # hashing it raised
    assert "error: malformed JSON in <tool_call>" in observation


def test_the_workspace_refuses_text_that_is_not_utf8():
    ws = Workspace(dict(LABEL["files"]), max_bytes=1 << 20, max_files=10)
    for change in (
        lambda: ws.write_file("calc/new.py", "\ud800"),
        lambda: ws.write_file("calc/\udfff.py", ""),
        lambda: ws.apply_patch("--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -2 +2 @@\n-    return a - b\n+    \ud800\n"),
    ):
        with pytest.raises(ToolError, match="valid UTF-8 text"):
            change()
    assert ws.files == LABEL["files"]


def test_swe_env_a_file_tool_that_raises_is_an_error_result_but_env_bugs_surface():
    env = swe_env()

    def broken(*args: object) -> str:
        raise KeyError("kaput")

    env.workspace.list_dir = broken
    observation = observation_of(env.step(tool_call("list_dir", path=".")))
    assert "error: list_dir: the tool failed (KeyError: 'kaput')" in observation
    env._run_suite = broken  # the env's own bookkeeping, not a tool: its bug still fails the step
    with pytest.raises(KeyError):
        env.step(tool_call("run_tests"))


# ---- 4: JSON nested past the recursion limit -----------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize(
    "action, error",
    [
        ("<tool_call>{}</tool_call>", "error: the tool call is nested too deeply"),
        ('<tool_call>{{"name": "read_file", "arguments": {{"path": {}}}}}</tool_call>', "nested too deeply"),
        ('<tool_call>{{"name": "read_file", "arguments": "{}"}}</tool_call>', "error: read_file: arguments are nested"),
    ],
)
def test_swe_env_json_nested_too_deeply_is_an_error_result(action, error, depth):
    observation = observation_of(swe_env().step(action.format("[" * depth)))
    assert error in observation


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_tool_env_arguments_nested_too_deeply_are_an_error_observation(depth):
    action = json.dumps({"tool": "calculator", "args": '{"expression": ' + "[" * depth})
    observation = observation_of(tool_env().step(action))
    assert observation == "<error>calculator: arguments are nested too deeply</error>\n"


# ---- 5: sandbox settings are checked where they are built ----------------------------------------
BAD_SETTINGS = [
    ({"timeout": 1}, "unknown sandbox setting 'timeout' (did you mean 'timeout_s'?); the settings are: mode,"),
    ({"memory": 256}, "(did you mean 'memory_mb'?)"),
    ({"timeout_s": float("inf")}, "timeout_s: Input should be a finite number"),  # every run: OverflowError
    ({"timeout_s": float("nan")}, "timeout_s: Input should be a finite number"),
    ({"timeout_s": 7200}, "timeout_s: Input should be less than or equal to 3600"),
    ({"cpu_s": 0}, "cpu_s: Input should be greater than or equal to 1"),  # every run: timeout
    ({"cpu_s": -1}, "cpu_s: Input should be greater than or equal to 1"),  # every run: prlimit's error
    ({"memory_mb": 10**12}, "memory_mb: Input should be less than or equal to 1048576"),
    ({"total_memory_mb": 10**12}, "total_memory_mb: Input should be less than or equal to 1048576"),
    ({"max_open_files": 10**9}, "max_open_files: Input should be less than or equal to 1048576"),
    ({"max_output_bytes": 0}, "max_output_bytes: Input should be greater than or equal to 256"),
    ({"extra_ro_binds": ["usr/lib"]}, "extra_ro_binds: must be absolute paths"),
    ({"env": {"A=B": "1"}}, "env: environment names must be non-empty and hold no '='"),
    ({"python": "/usr/bin/python3\x00"}, "python: must not contain NUL characters"),
]


@pytest.mark.parametrize("settings, error", BAD_SETTINGS)
def test_sandbox_settings_that_cannot_work_are_refused_naming_the_setting(settings, error):
    builders = {
        "Sandbox": lambda: Sandbox(settings),
        "SandboxPool": lambda: SandboxPool(settings),
        "ToolEnv": lambda: ToolEnv(tools=["python"], sandbox=settings),
        "ToolEnv without python": lambda: ToolEnv(tools=["calculator"], sandbox=settings),
        "SweEnv": lambda: SweEnv(sandbox=settings),
    }
    for build in builders.values():
        with pytest.raises(ValueError, match=re.escape(error)):
            build()
    with pytest.raises(UserError, match="^sandbox settings: "):  # the CLI shows it without a traceback
        Sandbox(settings)


def test_sandbox_settings_built_without_validation_are_checked_again():
    config = SandboxConfig().model_copy(update={"timeout_s": float("inf")})  # model_copy checks nothing
    with pytest.raises(ValueError, match="timeout_s: Input should be a finite number"):
        Sandbox(config)


@pytest.mark.parametrize(
    "settings",
    [None, {}, {"timeout_s": 3600, "cpu_s": 1, "memory_mb": 1 << 20}, {"timeout_s": 0.5, "extra_ro_binds": ["/opt"]}],
)
def test_sandbox_settings_within_bounds_are_kept(settings):
    config = Sandbox(settings).config
    assert config == SandboxConfig(**(settings or {}))
    assert SweEnv(sandbox=settings or {}).sandbox.config == config
