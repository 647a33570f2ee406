from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rewards.plugin import PluginError, load_function
from rewards.runner import RewardResult, RewardRunner
from slime.errors import UserError

# --- plugin loading --------------------------------------------------------------------------

PLUGIN_SOURCE = """
LIMIT = 3

def score(prompt, response, label, metadata):
    return float(response == label)

def _private():
    pass

class Judge:
    def __call__(self, prompt, response):
        return 1.0
"""


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    pkg = tmp_path / "slime_test_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(PLUGIN_SOURCE)
    (pkg / "needs_dep.py").write_text("import not_a_real_dependency_xyz\n")
    (pkg / "explodes.py").write_text("raise RuntimeError('bad config at import')\n")
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "my_reward.py").write_text(PLUGIN_SOURCE)
    return tmp_path


def test_load_module_and_file_specs(plugin_dir: Path) -> None:
    by_module = load_function("slime_test_plugins.good:score")
    by_file = load_function("rw/my_reward.py:score")
    assert by_module("p", "a", "a", {}) == 1.0 and by_file("p", "a", "b", {}) == 0.0
    assert load_function("rw/my_reward.py:score") is by_file  # a file is loaded once
    assert load_function(f"{plugin_dir}/rw/my_reward.py:score") is by_file  # absolute path, same file
    assert load_function("slime_test_plugins.good:Judge") is not None


@pytest.mark.parametrize(
    "spec, cause",
    [
        ("slime_test_plugins.good.score", r"has no ':'"),
        ("slime_test_plugins.good:", r"empty function name"),
        ("no_such_module_abc:score", r"module 'no_such_module_abc' not found"),
        ("slime_test_plugins.nope:score", r"module 'slime_test_plugins\.nope' not found"),
        (
            "slime_test_plugins.needs_dep:score",
            r"importing module 'slime_test_plugins\.needs_dep' failed: ModuleNotFoundError: "
            r"No module named 'not_a_real_dependency_xyz'",
        ),
        ("slime_test_plugins.explodes:score", r"failed: RuntimeError: bad config at import"),
        ("rw/missing.py:score", r"file not found: .*rw/missing\.py"),
        ("slime_test_plugins.good:scor", r"has no attribute 'scor'; callables it defines: Judge, score$"),
        ("rw/my_reward.py:scor", r"has no attribute 'scor'; callables it defines: Judge, score$"),
        ("slime_test_plugins.good:LIMIT", r"LIMIT is a int, not callable"),
    ],
)
def test_plugin_errors(plugin_dir: Path, spec: str, cause: str) -> None:
    with pytest.raises(PluginError, match=cause):
        load_function(spec)


def test_file_plugin_that_raises_on_import(plugin_dir: Path) -> None:
    (plugin_dir / "broken.py").write_text("x = 1\nraise ValueError('no key')\n")
    with pytest.raises(PluginError, match=r"running .*broken\.py failed: ValueError: no key"):
        load_function("broken.py:score")


def test_file_plugin_imports_modules_beside_it_like_a_script(tmp_path: Path) -> None:
    # A fresh interpreter started elsewhere, as a Ray worker is: the file's folder is not the cwd.
    folder = tmp_path / "task_dir"
    folder.mkdir()
    (folder / "slime_task_helper_abc.py").write_text("def grade(r):\n    return float(len(r))\n")
    (folder / "slime_lazy_helper_abc.py").write_text("BONUS = 0.5\n")
    (folder / "reward.py").write_text(
        "from slime_task_helper_abc import grade\n"
        "def reward(prompt, response, label, metadata):\n"
        "    import slime_lazy_helper_abc  # imported at call time, as scripts may\n"
        "    return grade(response) + slime_lazy_helper_abc.BONUS\n"
    )
    code = (
        "import sys; from rewards.plugin import load_function; "
        f"f = load_function({str(folder / 'reward.py')!r} + ':reward'); "
        "print(f('p', 'abc', None, {})); "
        f"print(sys.path.index({str(folder)!r}) == len(sys.path) - 1)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3.5", "True"]  # and the folder went last: it shadows nothing installed


def test_file_plugin_name_clash_with_an_installed_module_names_both(tmp_path: Path) -> None:
    folder = tmp_path / "clash"
    folder.mkdir()
    (folder / "yaml.py").write_text("def load(x):\n    return 'the local one'\n")
    (folder / "reward.py").write_text("import yaml\ndef reward(p, r, l, m):\n    return 1.0\n")
    with pytest.raises(PluginError, match=r"imports 'yaml', which is both .*clash/yaml\.py beside it and .*yaml"):
        load_function(f"{folder / 'reward.py'}:reward")
    assert str(folder) not in sys.path  # refused: nothing was changed


# --- runner ----------------------------------------------------------------------------------


def exact(prompt: str, response: str, label, metadata: dict) -> float:
    return float(response == label)


def test_sync_function() -> None:
    with RewardRunner(exact, timeout_s=5, max_concurrency=2) as runner:
        result = runner.score("q", "4", "4", {})
        assert result == RewardResult(1.0, None, result.latency_s) and result.ok
        assert runner.submit("q", "5", "4", {}).result().reward == 0.0


def test_async_function() -> None:
    async def slow_exact(prompt, response, label, metadata):
        await asyncio.sleep(0.01)
        return response == label

    with RewardRunner(slow_exact, timeout_s=5, max_concurrency=4) as runner:
        futures = [runner.submit("q", str(i % 2), "1", {}) for i in range(8)]
        assert [f.result().reward for f in futures] == [0.0, 1.0] * 4


def test_raising_function_fails_that_call_only() -> None:
    def picky(prompt, response, label, metadata):
        if response == "bad":
            raise ValueError("cannot parse 'bad'")
        return 1.0

    with RewardRunner(picky, timeout_s=5, max_concurrency=1) as runner:
        bad = runner.score("q", "bad", None, {})
        assert bad.reward is None
        assert "picky raised ValueError: cannot parse 'bad' (at test_rewards_runner.py:" in bad.failure
        assert runner.score("q", "good", None, {}).reward == 1.0


def test_hanging_sync_function_times_out_and_the_runner_keeps_serving() -> None:
    release = threading.Event()

    def sometimes_hangs(prompt, response, label, metadata):
        if response == "hang":
            release.wait(30)
        return 1.0

    with RewardRunner(sometimes_hangs, timeout_s=0.5, max_concurrency=1) as runner:
        try:
            t0 = time.monotonic()
            hung = runner.score("q", "hang", None, {})
            assert time.monotonic() - t0 < 1.0
            assert "sometimes_hangs timed out after 0.5s" in hung.failure and hung.reward is None
            assert runner.hung_calls == 1
            t0 = time.monotonic()
            assert runner.score("q", "fine", None, {}).reward == 1.0  # a fresh worker took its place
            assert time.monotonic() - t0 < 0.5
        finally:
            release.set()


def test_hung_threads_are_capped_and_rejoin_when_free() -> None:
    release = threading.Event()

    def hangs(prompt, response):
        if response == "hang":
            release.wait(30)
        return 1.0

    with RewardRunner(hangs, timeout_s=0.2, max_concurrency=1, max_hung_calls=0) as runner:
        assert "timed out" in runner.score("q", "hang").failure
        refused = runner.score("q", "fine")
        assert "not called: all worker threads are stuck" in refused.failure
        release.set()
        deadline = time.monotonic() + 2
        while runner.hung_calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.score("q", "fine").reward == 1.0  # the freed thread rejoined the pool


def test_hanging_async_function_is_cancelled() -> None:
    async def hangs(prompt, response, label, metadata):
        if response == "hang":
            await asyncio.sleep(30)
        return 0.25

    with RewardRunner(hangs, timeout_s=0.5, max_concurrency=1) as runner:
        t0 = time.monotonic()
        assert "timed out after 0.5s" in runner.score("q", "hang").failure
        assert time.monotonic() - t0 < 1.0
        assert runner.score("q", "fine").reward == 0.25


@pytest.mark.parametrize(
    "value, reward, failure",
    [
        (True, 1.0, None),
        (False, 0.0, None),
        (3, 3.0, None),
        ({"score": 0.5, "acc": True}, 0.5, None),
        (float("nan"), None, "returned nan, not a finite number"),
        (-math.inf, None, "returned -inf, not a finite number"),
        (1e300, None, "returned 1e+300, beyond ±1e+15 (the float32 learner would overflow)"),
        (-1e15, -1e15, None),
        ("abc", None, "returned str 'abc', not a number"),
        (None, None, "returned None"),
        ({"acc": 1.0}, None, "returned a dict without a 'score' key (keys: ['acc'])"),
        ([1.0], None, "returned list [1.0], not a number"),
        # numpy's float() of a complex number dropped its imaginary part: 1+2j scored 1.0
        (np.complex128(1 + 2j), None, "returned the complex number np.complex128(1+2j), not a real one"),
        ({"score": np.complex64(1)}, None, "returned the complex number np.complex64(1+0j), not a real one"),
        (np.float64(0.5), 0.5, None),
    ],
)
def test_return_values(value, reward: float | None, failure: str | None) -> None:
    def constant(prompt, response, label, metadata):
        return value

    with RewardRunner(constant, timeout_s=5, max_concurrency=1) as runner:
        result = runner.score("q", "r", None, {})
    assert result.reward == reward
    if failure is None:
        assert result.failure is None
    else:
        assert f"constant {failure}" in result.failure


def test_only_accepted_keywords_are_passed() -> None:
    seen: list[dict] = []

    def no_metadata(prompt, response, label):
        return float(label)

    def everything(prompt, response, **kwargs):
        seen.append(kwargs)
        return 0.0

    with RewardRunner(no_metadata, timeout_s=5, max_concurrency=1) as runner:
        assert runner.score("q", "r", 1, {"task": "x"}).reward == 1.0
    with RewardRunner(everything, timeout_s=5, max_concurrency=1) as runner:
        runner.score("q", "r", "L", {"task": "x"})
    assert seen == [{"label": "L", "metadata": {"task": "x"}}]


def test_signature_that_cannot_take_the_native_call_fails_at_construction() -> None:
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    with pytest.raises(TypeError, match=r"does not take \['prompt', 'response'\] as keyword arguments"):
        RewardRunner(compute_score, timeout_s=1, max_concurrency=1)

    def needs_more(prompt, response, tokenizer):
        return 0.0

    with pytest.raises(TypeError, match=r"requires \['tokenizer'\], which are never passed") as raised:
        RewardRunner(needs_more, timeout_s=1, max_concurrency=1)
    assert isinstance(raised.value, UserError)  # the CLI's one line, not a traceback


def test_a_rewards_info_reaches_the_sample_as_json() -> None:
    """`info` is stored in the sample's metadata (JSON in Redis): a numpy number in it stopped the
    rollout worker; now numpy scalars are numbers and anything else JSON cannot hold is text."""
    import numpy as np

    def score(prompt, response):
        return {"score": 0.5, "info": {"acc": np.float32(0.25), "ok": np.bool_(True), "when": object}}

    with RewardRunner(score, timeout_s=5, max_concurrency=1) as runner:
        result = runner.score("q", "r", None, {})
    assert result.reward == 0.5 and result.failure is None
    assert result.info == {"acc": 0.25, "ok": True, "when": str(object)}


def test_concurrency_limit() -> None:
    running = peak = 0
    lock = threading.Lock()

    def slow(prompt, response):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return 1.0

    with RewardRunner(slow, timeout_s=5, max_concurrency=2) as runner:
        results = [f.result() for f in [runner.submit("q", "r") for _ in range(6)]]
    assert all(r.ok for r in results) and peak == 2


def test_close_resolves_pending_calls_and_refuses_new_ones() -> None:
    release = threading.Event()

    def waits(prompt, response):
        release.wait(5)
        return 1.0

    runner = RewardRunner(waits, timeout_s=5, max_concurrency=1)
    futures = [runner.submit("q", "r") for _ in range(3)]
    runner.close()
    release.set()
    assert all("RewardRunner was closed" in f.result(timeout=1).failure for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit("q", "r")


def test_an_async_reward_that_blocks_its_loop_fails_the_calls_on_it_and_a_new_loop_serves_the_next():
    """`time.sleep` in an `async def` blocks the runner's event loop: the call past its deadline
    times out, the call queued behind it (never started, so it had no deadline) fails naming the
    cause instead of waiting forever, and the next call runs on a fresh loop."""
    release = threading.Event()
    blocked = []

    async def blocks_once(prompt, response):
        if not blocked:
            blocked.append(True)
            release.wait(60)  # blocking, not awaited
        return 1.0

    runner = RewardRunner(blocks_once, timeout_s=0.5, max_concurrency=4)
    try:
        first = runner.submit("p", "r0")
        time.sleep(0.2)
        queued = runner.submit("p", "r1")
        assert "timed out after 0.5s" in first.result(timeout=10).failure
        failure = queued.result(timeout=10).failure
        assert "blocked its event loop past timeout_s=0.5" in failure and "asyncio.sleep" in failure
        assert runner.submit("p", "r2").result(timeout=10).reward == 1.0  # the new loop
    finally:
        release.set()
        runner.close()


EXITING_REWARDS = """
import asyncio, os, sys
from rewards.runner import RewardRunner

def hard(prompt, response):
    os._exit(3)

def soft(prompt, response):
    sys.exit(2)

async def hard_async(prompt, response):
    await asyncio.sleep(0)
    os._exit(3)

async def soft_async(prompt, response):
    sys.exit("done")

for fn in (hard, soft, hard_async, soft_async):
    with RewardRunner(fn, timeout_s=10, max_concurrency=2) as runner:
        first, second = runner.score("p", "a"), runner.score("p", "b")  # the runner serves on after an exit
        print(fn.__name__, "|", first.failure, "|", second.failure, flush=True)
print("still running", flush=True)
"""


def test_a_reward_that_exits_fails_its_call_and_the_process_lives(tmp_path: Path) -> None:
    """os._exit in a reward ended the rollout worker at once (the whole job under the local
    launcher) with an error that named no reward; sys.exit in an async reward stopped its loop."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_REWARDS)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0 and done.stdout.rstrip().endswith("still running"), done.stdout + done.stderr
    lines = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    assert set(lines) == {"hard", "soft", "hard_async", "soft_async"}
    for name, failures in lines.items():
        first, second = failures.split(" | ")
        assert first.startswith(f"reward function __main__.{name} raised") and first == second, failures
    assert "SystemExit: os._exit(3) (at exiting.py:6)" in lines["hard"] and "os._exit(3)" in lines["hard_async"]
    assert "SystemExit: 2" in lines["soft"] and "exited (done)" in lines["soft_async"]
