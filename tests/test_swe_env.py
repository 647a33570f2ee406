"""The software-engineering env (envs/swe.py), its workspace and patches (envs/swe_workspace.py),
its test runner (envs/swe_runner.py) and its tasks (envs/swe_tasks.py, envs/swe_templates).

The tests that run code use the real bubblewrap sandbox (skipped where it is unusable, failing
in CI like tests/test_sandbox.py); each sandbox run costs about 0.1 s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from envs.sandbox import Sandbox
from envs.swe import SweEnv, parse_tool_calls
from envs.swe_runner import run_suite
from envs.swe_tasks import (
    TEMPLATES,
    dataset_text,
    generate_tasks,
    long_reference_actions,
    reference_actions,
    tool_call,
)
from envs.swe_workspace import PathOutsideWorkspace, ToolError, Workspace
from slime.config import load_config
from slime.sample import Sample
from tests.helpers import needs

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "swe_tasks.jsonl"
TASKS = generate_tasks()
_probe_error = Sandbox()._probe()
sandboxed = needs(_probe_error is None, f"bubblewrap sandbox unusable here: {_probe_error}")

# A two-bug repository: add and mul are wrong (2 failing tests), sub is right (1 passing test).
TOY = {
    "task_id": "toy",
    "files": {
        "calc/__init__.py": "",
        "calc/ops.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a + b\n\n\n"
        "def sub(a, b):\n    return a - b\n",
        "tests/test_ops.py": "import unittest\n\nfrom calc.ops import add, mul, sub\n\n\n"
        "class TestOps(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n\n"
        "    def test_sub(self):\n        self.assertEqual(sub(5, 3), 2)\n",
    },
    "test_files": ["tests/test_ops.py"],
}


def sample_of(label: object) -> Sample:
    return Sample(group_id="g", index=0, prompt_ids=[1], max_new_tokens=8, metadata={"label": label})


def env_for(label: dict, **kwargs) -> SweEnv:
    env = SweEnv(**kwargs)
    assert env.reset(sample_of(label)) == ""
    return env


def play(env: SweEnv, actions: list[str]) -> list[tuple[str, float, bool, dict]]:
    return [env.step(a) for a in actions]


def write(path: str, content: str) -> str:
    return tool_call("write_file", path=path, content=content)


# ---- tasks ---------------------------------------------------------------------------------------
def test_shipped_data_is_the_generators_output():
    assert DATA.read_text() == dataset_text(generate_tasks(24, 0)), (
        "examples/data/swe_tasks.jsonl is stale: python -m envs.swe_tasks --out examples/data/swe_tasks.jsonl"
    )
    first = json.loads(DATA.read_text().splitlines()[0])
    assert set(first) == {"prompt", "label", "task"} and first["task"] == "swe"
    assert set(first["label"]) == {"task_id", "files", "test_files"}
    assert "<tool_call>" in first["prompt"] and "finish" in first["prompt"]


def test_generator_is_deterministic_and_uses_every_template():
    assert len(TEMPLATES) >= 5
    assert [t.task_id for t in generate_tasks(24, 0)] == [t.task_id for t in TASKS]
    assert [t.task_id for t in generate_tasks(24, 1)] != [t.task_id for t in TASKS]
    assert len({t.task_id for t in TASKS}) == 24
    assert {t.template for t in TASKS} == {t.name for t in TEMPLATES}
    with pytest.raises(ValueError, match="n must be within"):
        generate_tasks(1000)


def test_the_example_config_loads_and_fits_the_tasks():
    cfg = load_config(str(ROOT / "examples" / "swe_agent.yaml"), [])
    assert cfg.env.plugin == "envs.swe:SweEnv" and cfg.data.path == "examples/data/swe_tasks.jsonl"
    SweEnv(**cfg.env.kwargs)
    longest = max(len(json.loads(line)["prompt"]) for line in DATA.read_text().splitlines())
    assert longest <= cfg.data.max_prompt_tokens  # the char tokenizer: one token per character
    assert longest + cfg.rollout.max_new_tokens <= cfg.model.tiny.max_position_embeddings


def test_each_fix_turns_the_buggy_module_back_into_the_correct_one():
    templates = {t.name: t for t in TEMPLATES}
    for task in generate_tasks(sum(len(t.mutations) for t in TEMPLATES)):
        ws = Workspace(dict(task.files), 1 << 20, 100)
        ws.apply_patch(task.fix)
        assert ws.files == templates[task.template].files, task.task_id


@sandboxed
def test_every_mutation_fails_exactly_its_tests_and_the_correct_package_passes():
    sandbox = Sandbox()

    def check(job):
        template, mutation = job
        files = template.files if mutation is None else template.buggy_files(mutation)
        return job, run_suite(sandbox, files, template.test_files)

    jobs = [(t, None) for t in TEMPLATES] + [(t, m) for t in TEMPLATES for m in t.mutations]
    with ThreadPoolExecutor(2) as pool:
        for (template, mutation), run in pool.map(check, jobs):
            assert run.sandbox_status == "ok" and run.complete, (template.name, run)
            if mutation is None:
                assert run.not_passed == [] and len(run.outcomes) >= 15, template.name
            else:
                assert run.not_passed == list(mutation.failing_tests), (template.name, mutation.key)
                assert run.passed, (template.name, mutation.key)


# ---- whole episodes ------------------------------------------------------------------------------
@sandboxed
def test_the_scripted_policy_solves_every_shipped_task():
    def episode(task):
        env = env_for(task.label())
        return task.task_id, play(env, reference_actions(task))

    with ThreadPoolExecutor(2) as pool:
        for task_id, steps in pool.map(episode, TASKS):
            rewards = [r for _, r, _, _ in steps]
            assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0], (task_id, steps[-2][0])
            assert [d for _, _, d, _ in steps] == [False] * 4 + [True], task_id
            assert steps[-1][3]["end_reason"] == "finish"
            assert "0 failed, 0 errors" in steps[3][0], (task_id, steps[3][0])


@sandboxed
def test_doing_nothing_earns_nothing():
    task = TASKS[0]
    _, reward, done, info = env_for(task.label()).step(tool_call("finish"))
    assert (reward, done, info["end_reason"]) == (0.0, True, "finish")
    assert info["tests_passed"] < info["tests_total"]
    env = env_for(task.label())
    steps = play(env, long_reference_actions(task, 12)[:9])  # reads around, never finishes
    assert sum(r for _, r, _, _ in steps) == 0.0 and not any(d for _, _, d, _ in steps)


@sandboxed
def test_partial_fix_earns_a_share_and_breaking_a_passing_test_costs_it():
    fix_add = write(
        "calc/ops.py", TOY["files"]["calc/ops.py"].replace("return a - b\n\n\ndef mul", "return a + b\n\n\ndef mul")
    )
    _, reward, done, info = play(env_for(TOY), [fix_add, tool_call("finish")])[-1]
    assert done and reward == pytest.approx(0.5) and info["tests_passed"] == 2
    fixed_both_broke_sub = write(
        "calc/ops.py",
        "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef sub(a, b):\n    return 0\n",
    )
    _, reward, _, _ = play(env_for(TOY), [fixed_both_broke_sub, tool_call("finish")])[-1]
    assert reward == pytest.approx(0.5)  # 2 fixed, 1 broken, of 2 failing at the start
    steps = play(
        env_for(TOY),
        [
            write(
                "calc/ops.py",
                "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef sub(a, b):\n    return a - b\n",
            ),
            tool_call("run_tests"),
            tool_call("finish"),
        ],
    )
    assert [r for _, r, _, _ in steps] == [0.0, 0.0, 1.0]


def test_mistakes_are_error_observations_and_the_episode_goes_on():
    env = env_for(TOY)
    cases = {
        "no call at all": ("I think the bug is in add.", "no tool call found"),
        "malformed JSON": ('<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>', "malformed JSON"),
        "unknown tool": ('<tool_call>{"name": "grep", "arguments": {}}</tool_call>', "unknown tool 'grep'"),
        "missing argument": (
            '<tool_call>{"name": "read_file", "arguments": {}}</tool_call>',
            'missing argument "path"',
        ),
        "unknown argument": (tool_call("list_dir", path=".", depth=2), 'unknown argument "depth"'),
        "unclosed call": ('<tool_call>{"name": "list_dir"}', "never closed"),
        "missing file": (tool_call("read_file", path="calc/nope.py"), "no such file"),
        "bad patch": (
            tool_call(
                "apply_patch",
                patch="--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a * b\n+    return a + b\n",
            ),
            "calc/ops.py: hunk 1 (@@ -1,2 +1,2 @@) does not match",
        ),
        "not a diff": (tool_call("apply_patch", patch="please fix add"), "no file header"),
    }
    for what, (action, expected) in cases.items():
        observation, reward, done, info = env.step(action)
        assert expected in observation and "error: " in observation, (what, observation)
        assert (reward, done) == (0.0, False), what
    assert env.workspace.files == TOY["files"]
    openai_style = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"calc/ops.py\\", \\"end_line\\": 2}"}</tool_call>'
    observation, _, done, _ = env.step(openai_style)
    assert "   1| def add(a, b):\n   2|     return a - b\n" in observation and not done


def test_a_patch_applies_all_or_nothing():
    ops = TOY["files"]["calc/ops.py"]
    good = (
        "--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    )
    bad = "--- a/calc/__init__.py\n+++ b/calc/__init__.py\n@@ -1,1 +1,1 @@\n-nothing\n+x\n"
    ws = Workspace(dict(TOY["files"]), 1 << 20, 100)
    with pytest.raises(ToolError, match="calc/__init__.py: hunk 1"):
        ws.apply_patch(good + bad)
    assert ws.files["calc/ops.py"] == ops
    # git's preamble is skipped, and a hunk found a few lines off its header's line still applies
    shifted = "diff --git a/calc/ops.py b/calc/ops.py\nindex 1..2 100644\n" + good.replace(
        "@@ -1,2 +1,2 @@", "@@ -4,2 +4,2 @@"
    )
    ws.apply_patch(shifted)
    assert ws.files["calc/ops.py"].startswith("def add(a, b):\n    return a + b\n")
    ws.apply_patch("--- /dev/null\n+++ b/calc/extra.py\n@@ -0,0 +1,2 @@\n+X = 1\n+Y = 2\n")
    assert ws.files["calc/extra.py"] == "X = 1\nY = 2\n"
    ws.apply_patch("--- a/calc/extra.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-X = 1\n-Y = 2\n")
    assert "calc/extra.py" not in ws.files
    with pytest.raises(ToolError, match="ends early"):
        ws.apply_patch("--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,5 +1,5 @@\n def add(a, b):\n")
    with pytest.raises(PathOutsideWorkspace):
        ws.apply_patch("--- /dev/null\n+++ ../evil.py\n@@ -0,0 +1 @@\n+x\n")


def test_read_file_numbers_lines_and_caps_them():
    env = env_for(TOY, max_read_lines=3)
    observation, _, _, _ = env.step(tool_call("read_file", path="calc/ops.py", start_line=2))
    assert observation.startswith("<tool_response>\n   2|     return a - b\n   3| \n   4| \n")
    assert "read_file with start_line=5 for more" in observation
    listing, _, _, _ = env.step(tool_call("list_dir"))
    assert (
        listing
        == "<tool_response>\ncalc/\ncalc/__init__.py\ncalc/ops.py\ntests/\ntests/test_ops.py\n</tool_response>\n"
    )


def test_calls_per_turn_are_capped():
    env = env_for(TOY, max_calls_per_turn=2)
    observation, _, _, info = env.step(
        tool_call("list_dir") + tool_call("list_dir", path="calc") + tool_call("list_dir", path="tests")
    )
    assert observation.count("<tool_response>") == 3 and "at most 2 tool calls per turn; 1 skipped" in observation
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    "action",
    [
        write("../x.py", "print(1)"),
        write("/etc/x", "print(1)"),
        tool_call("read_file", path="calc/../../etc/passwd"),
        tool_call("list_dir", path="/"),
        tool_call("apply_patch", patch="--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n"),
    ],
)
def test_a_path_outside_the_workspace_ends_the_episode(action):
    observation, reward, done, info = env_for(TOY).step(action)
    assert (reward, done, info["end_reason"]) == (0.0, True, "path_outside_workspace")
    assert "absolute path" in info["end_detail"] or "leaves the repository" in info["end_detail"]


def test_tests_and_reserved_names_are_read_only():
    env = env_for(TOY)
    attempts = [
        write("tests/test_ops.py", "import unittest\n"),
        write("tests/test_new.py", "import unittest\n"),
        tool_call(
            "apply_patch",
            patch="--- a/tests/test_ops.py\n+++ b/tests/test_ops.py\n@@ -1 +1 @@\n-import unittest\n+import os\n",
        ),
        write("_sandbox_main.py", "print(1)\n"),
        write("calc/ops.py/inner.py", "x = 1\n"),
        write("calc", "x = 1\n"),
    ]
    for action in attempts:
        observation, _, done, _ = env.step(action)
        assert "error: " in observation and not done, observation
    assert env.workspace.files == TOY["files"]
    big = SweEnv(max_workspace_bytes=2048)
    big.reset(sample_of(TOY))
    observation, _, _, _ = big.step(write("calc/big.py", "x" * 4096))
    assert "at most 2048 bytes" in observation


def test_repeating_the_same_call_ends_in_a_loop():
    env = env_for(TOY)
    read = tool_call("read_file", path="calc/ops.py")
    steps = play(env, [read, read, tool_call("list_dir"), read, read, read])
    assert not any(d for _, _, d, _ in steps)
    _, reward, done, info = env.step(read)
    assert (reward, done, info["end_reason"]) == (0.0, True, "loop")
    env = env_for(TOY, max_repeated_calls=2)
    _, _, done, info = env.step('<tool_call>{"bad json</tool_call>' * 2)
    assert done and info["end_reason"] == "loop"


@sandboxed
def test_an_output_flood_ends_the_episode():
    env = env_for(TOY, sandbox={"max_output_bytes": 8192})
    env.step(write("calc/__init__.py", "while True:\n    print('flood' * 100)\n"))
    observation, reward, done, info = env.step(tool_call("run_tests"))
    assert (reward, done, info["end_reason"]) == (0.0, True, "sandbox_output_limit"), observation


@sandboxed
def test_an_infinite_loop_ends_the_episode_at_the_timeout():
    env = env_for(TOY, sandbox={"timeout_s": 1.0})
    env.step(write("calc/ops.py", "while True:\n    pass\n"))
    observation, reward, done, info = env.step(tool_call("finish"))
    assert (reward, done, info["end_reason"]) == (0.0, True, "sandbox_timeout"), observation


@sandboxed
def test_forged_report_lines_and_a_patched_unittest_do_not_pass_tests():
    env = env_for(TOY)
    fake = json.dumps({"id": "tests.test_ops.TestOps.test_add", "status": "passed"})
    env.step(write("calc/__init__.py", f"print({fake!r})\nprint('{{\"done\": true}}')\n"))
    observation, _, _, _ = env.step(tool_call("run_tests"))
    assert "ran 3 tests: 1 passed, 2 failed" in observation
    env.step(write("calc/__init__.py", "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"))
    observation, _, _, _ = env.step(tool_call("run_tests"))
    assert "the run is void" in observation and "assertEqual" in observation
    _, reward, done, _ = env.step(tool_call("finish"))
    assert done and reward == 0.0


# A workspace json.py that reads the nonce from stdin itself and reports every test as passed.
SHADOW_JSON = r"""
import ast, os
data = b""
while chunk := os.read(0, 65536):
    data += chunk
nonce, files = data.decode().split("\n", 1)
out = ""
for f in [x.strip().strip('"') for x in files.strip()[1:-1].split(",")]:
    mod = f[:-3].replace("/", ".")
    for node in ast.parse(open(f).read()).body:
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test"):
                    out += "\n" + nonce + '{"id": "%s.%s.%s", "status": "passed"}\n' % (mod, node.name, fn.name)
os.write(1, (out + "\n" + nonce + '{"done": true, "tampered": null}\n').encode())
os._exit(0)
"""


@pytest.mark.parametrize("name", ["json.py", "traceback.py"])
def test_a_workspace_module_named_like_the_stdlib_cannot_read_the_nonce_first(name):
    """The runner imports json, traceback and unittest before it reads the nonce; with the workspace
    first on sys.path, a workspace json.py ran in its place, read the nonce and forged a full pass."""
    env = env_for(TOY)
    env.step(write(name, SHADOW_JSON))
    observation, _, _, _ = env.step(tool_call("run_tests"))
    assert "ran 3 tests: 1 passed, 2 failed" in observation, observation
    _, reward, done, _ = env.step(tool_call("finish"))
    assert done and reward < 1.0


def test_qwen_chat_format_wraps_the_tool_turn():
    env = env_for(TOY, chat_format="qwen")
    observation, _, _, _ = env.step(tool_call("list_dir", path="calc"))
    assert observation == (
        "\n<|im_start|>user\n<tool_response>\ncalc/__init__.py\ncalc/ops.py\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_kwargs_and_bad_task_data_are_clear_errors():
    with pytest.raises(ValueError, match="max_calls_per_turn"):
        SweEnv(max_calls_per_turn=0)
    with pytest.raises(ValueError, match="unknown_option"):
        SweEnv(unknown_option=1)
    with pytest.raises(ValueError, match="sandbox.timeout_s"):
        SweEnv(sandbox={"timeout_s": -1})
    sample = sample_of("not a dict")
    with pytest.raises(ValueError, match=f"sample {sample.id}: metadata\\['label'\\] must be a dict"):
        SweEnv().reset(sample)
    with pytest.raises(ValueError, match="label.test_files"):
        SweEnv().reset(sample_of({"task_id": "t", "files": {"a.py": ""}}))
    with pytest.raises(ValueError, match="label.files"):
        SweEnv().reset(sample_of({"task_id": "t", "test_files": ["tests/test_a.py"]}))
    with pytest.raises(ValueError, match="tests/test_b.py"):
        SweEnv().reset(sample_of({**TOY, "test_files": ["tests/test_b.py"]}))


# ---- snapshot / restore --------------------------------------------------------------------------
@sandboxed
def test_snapshot_and_restore_continue_exactly_like_the_original():
    task = TASKS[3]
    read = tool_call("read_file", path=task.buggy_path, start_line=1, end_line=20)
    before = [tool_call("list_dir"), tool_call("run_tests"), read, read, write("NOTES.md", "looked at it\n")]
    after = [
        read,
        tool_call("apply_patch", patch=task.fix),
        tool_call("read_file", path="NOTES.md"),
        tool_call("run_tests"),
        tool_call("finish"),
    ]
    original = env_for(task.label())
    play(original, before)
    snapshot = json.loads(json.dumps(original.snapshot()))
    assert snapshot["changed"] == {"NOTES.md": "looked at it\n"} and snapshot["baseline"] is not None
    resumed = SweEnv()
    resumed.reset(sample_of(task.label()))
    resumed.restore(sample_of(task.label()), snapshot)
    assert resumed.snapshot() == snapshot
    for action in after:
        assert resumed.step(action) == original.step(action), action
        assert resumed.workspace.files == original.workspace.files
    assert original.done and resumed.snapshot() == original.snapshot()


def test_restore_keeps_the_repeat_counter_and_checks_the_task():
    read = tool_call("read_file", path="calc/ops.py")
    original = env_for(TOY)
    play(original, [read, read, read])
    resumed = env_for(TOY)
    resumed.restore(sample_of(TOY), json.loads(json.dumps(original.snapshot())))
    assert resumed.step(read) == original.step(read)
    assert resumed.done and resumed.end_reason == "loop"
    other = env_for(TASKS[0].label())
    with pytest.raises(ValueError, match="snapshot is of task toy"):
        other.restore(sample_of(TASKS[0].label()), original.snapshot())
