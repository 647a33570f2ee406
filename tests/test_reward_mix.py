"""rewards.mix: WeightedSum, RouteByField and load_reward_spec, with every error message checked."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rewards.adapters import DoesNotApply, adapt
from rewards.mix import (
    NoRouteError,
    RewardChildError,
    RewardSpecError,
    RouteByField,
    WeightedSum,
    load_reward_spec,
)
from rewards.rule import exact_match, f1
from rewards.runner import RewardResult, RewardRunner, StepScores
from tests.helpers import run_until_still_running


def half(prompt, response):
    return 0.5


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth)}


def trl_style(completions, **kwargs):
    return [2.0 for _ in completions]


def boom(prompt, response):
    raise KeyError("missing")


def not_a_number(prompt, response):
    return "high"


def test_weighted_sum_sync_mixes_styles():
    fn = WeightedSum([(exact_match, 0.7), (f1, 0.2), (verl_style, 0.1), (trl_style, -0.05)])
    assert not inspect.iscoroutinefunction(fn)
    # exact 1*0.7 + f1 1*0.2 + verl 1*0.1 + trl 2*(-0.05)
    assert fn("q", "the cat", "the cat", {}) == pytest.approx(0.7 + 0.2 + 0.1 - 0.1)
    # exact 0, f1: [cat] vs [cat, sat] -> P=1, R=1/2, F1=2/3; verl 0; trl -0.1
    assert fn("q", "cat", "cat sat", {}) == pytest.approx(0.2 * 2 / 3 - 0.1)
    assert WeightedSum([("rewards.rule:exact_match", 2)])("q", "a", "a", {}) == 2.0


def test_weighted_sum_async_runs_children_concurrently_and_sync_ones_off_the_loop():
    loop_threads = []

    async def slow_a(prompt, response):
        loop_threads.append(threading.current_thread())
        await asyncio.sleep(0.15)
        return 1.0

    async def slow_b(args, sample):  # slime style
        await asyncio.sleep(0.15)
        return 2.0

    def sync_child(prompt, response):
        assert threading.current_thread() is not loop_threads[0]
        time.sleep(0.15)
        return 4.0

    fn = WeightedSum([(slow_a, 1.0), (slow_b, 0.5), (sync_child, 0.25)])
    assert inspect.iscoroutinefunction(fn)
    start = time.monotonic()
    assert asyncio.run(fn("q", "r", None, {})) == pytest.approx(1.0 + 1.0 + 1.0)
    assert time.monotonic() - start < 0.4  # sequential would take 0.45 s


def test_weighted_sum_child_failures_name_the_child():
    with pytest.raises(RewardChildError, match=r"child reward .*boom raised KeyError: 'missing'"):
        WeightedSum([(half, 1.0), (boom, 1.0)])("q", "r", None, {})
    with pytest.raises(RewardChildError, match=r"reward .*not_a_number returned str 'high', not a number"):
        WeightedSum([(not_a_number, 1.0)])("q", "r", None, {})

    async def async_boom(prompt, response):
        raise ValueError("judge down")

    with pytest.raises(RewardChildError, match=r"child reward .*async_boom raised ValueError: judge down"):
        asyncio.run(WeightedSum([(half, 1.0), (async_boom, 1.0)])("q", "r", None, {}))


def test_weighted_sum_bad_arguments():
    with pytest.raises(ValueError, match="WeightedSum needs at least one"):
        WeightedSum([])
    with pytest.raises(ValueError, match=r"WeightedSum item 0: weight must be a finite number, got 'a lot'"):
        WeightedSum([(half, "a lot")])
    with pytest.raises(TypeError, match=r"WeightedSum item 0 must be a \(fn, weight\) pair"):
        WeightedSum([half])
    with pytest.raises(TypeError, match=r"a reward must be a callable or a spec string, got int 3"):
        WeightedSum([(3, 1.0)])


def test_route_by_field():
    fn = RouteByField("task", {"qa": f1, "exact": exact_match}, default=half)
    assert fn("q", "cat", "cat sat", {"task": "qa"}) == pytest.approx(2 / 3)
    assert fn("q", "cat", "cat sat", {"task": "exact"}) == 0.0
    assert fn("q", "cat", "cat sat", {"task": "other"}) == 0.5
    assert fn("q", "cat", "cat sat", {}) == 0.5


def test_route_without_match_names_the_value_and_routes():
    fn = RouteByField("task", {"math": "rewards.rule:math_answer", "qa": f1})
    with pytest.raises(NoRouteError, match=r"no reward for task='code'; known routes: \['math', 'qa'\] and no default"):
        fn("q", "r", "l", {"task": "code"})
    with pytest.raises(NoRouteError, match=r"no reward for no 'task' field; known routes: \['math', 'qa'\]"):
        fn("q", "r", "l", {})
    with RewardRunner(fn, 5.0, 1) as runner:  # the runner turns it into a failed sample
        result = runner.score("q", "r", "l", {"task": "code"})
        assert result.reward is None and "NoRouteError" in result.failure and "task='code'" in result.failure


def test_route_async_when_any_route_is():
    async def judge(prompt, response):
        return 0.25

    fn = RouteByField("task", {"chat": judge, "qa": f1})
    assert inspect.iscoroutinefunction(fn)
    assert asyncio.run(fn("q", "x", "x", {"task": "chat"})) == 0.25
    assert asyncio.run(fn("q", "x", "x", {"task": "qa"})) == 1.0


def test_load_reward_spec_recursive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "judge.py").write_text("def f(completions, **kwargs):\n    return [0.5 for _ in completions]\n")
    spec = {
        "route": "task",
        "routes": {
            "qa": {"mix": [{"fn": "rewards.rule:exact_match", "weight": 0.7}, {"fn": "judge.py:f", "weight": 0.3}]},
            "math": "rewards.rule:math_answer",
        },
        "default": {"fn": "judge.py:f", "style": "trl"},
    }
    fn = load_reward_spec(spec)
    assert fn("q", "Paris", "paris", {"task": "qa"}) == pytest.approx(0.7 + 0.15)
    assert fn("q", r"\boxed{\frac{1}{2}}", "0.5", {"task": "math"}) == 1.0
    assert fn("q", "x", "y", {"task": "poetry"}) == 0.5
    assert load_reward_spec("rewards.rule:f1")("q", "a b", "a b", {}) == 1.0


def test_the_spec_examples_in_docs_load_and_score():
    """docs/rewards.md's spec dicts, as a user copies them (the mix's length_penalty is a factory:
    its first example named it bare and failed to load)."""
    import re

    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    block = re.search(r"```yaml\nreward:\n(.*?)```", text, re.DOTALL).group(1)
    specs = [yaml.safe_load(line.lstrip("# "))["fn"] for line in re.split(r"\n(?=  #? ?fn:)", block) if "fn:" in line]
    assert len(specs) == 3
    mixed, routed = load_reward_spec(specs[0]), load_reward_spec(specs[1])
    assert mixed("q", r"\boxed{4}", "4", {}) == pytest.approx(0.8)  # exact_match of the boxed text is 0
    assert routed("q", "a b", "a b", {"task": "poetry"}) == 1.0  # the default: f1


def test_load_reward_spec_errors_give_the_path():
    with pytest.raises(RewardSpecError, match=r"reward\.mix\.0\.wieght: Extra inputs are not permitted"):
        load_reward_spec({"mix": [{"fn": "rewards.rule:f1", "wieght": 1.0}]})
    with pytest.raises(RewardSpecError, match=r"reward\.mix\.0\.weight: Field required"):
        load_reward_spec({"mix": [{"fn": "rewards.rule:f1"}]})
    with pytest.raises(RewardSpecError, match=r"reward\.mix\.0\.weight: Input should be a valid number"):
        load_reward_spec({"mix": [{"fn": "rewards.rule:f1", "weight": "heavy"}]})
    with pytest.raises(RewardSpecError, match=r"reward\.mix: List should have at least 1 item"):
        load_reward_spec({"mix": []})
    with pytest.raises(
        RewardSpecError, match=r"reward\.routes\.qa: unrecognised keys \['func'\]; expected a spec string"
    ):
        load_reward_spec({"route": "task", "routes": {"qa": {"func": "x:y"}}})
    with pytest.raises(
        RewardSpecError, match=r"reward\.routes: Value error, routes must name at least one field value"
    ):
        load_reward_spec({"route": "task", "routes": {}})
    with pytest.raises(
        RewardSpecError, match=r"reward\.style: Input should be 'native', 'slime', 'verl', 'trl' or 'openrlhf'"
    ):
        load_reward_spec({"fn": "rewards.rule:f1", "style": "deepspeed"})
    with pytest.raises(RewardSpecError, match=r"reward\.mix\.0\.fn: expected a spec string .*; got int 5"):
        load_reward_spec({"mix": [{"fn": 5, "weight": 1.0}]})


def test_a_trl_reward_that_does_not_apply_is_left_out_of_the_mix_as_trl_does():
    """TRL sums its reward functions with nansum: a None (accuracy_reward on an unparsable answer)
    leaves that function out. The mix does the same; when no part applies, the sample fails."""

    def picky(completions, **kwargs):
        return [None if c == "skip" else 1.0 for c in completions]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    mix = WeightedSum([(picky, 0.5), (length, 2.0)])
    assert mix("p", "ab", None, {}) == 0.5 * 1.0 + 2.0 * 2
    assert mix("p", "skip", None, {}) == 2.0 * 4  # picky left out
    with pytest.raises(DoesNotApply, match="none of its rewards applies to this sample"):
        WeightedSum([(picky, 1.0)])("p", "skip", None, {})
    with pytest.raises(DoesNotApply, match="returned \\[None\\]: it does not apply to this sample"):
        adapt(picky)("p", "skip", None, {})


STEPS_FILE = """
def steps(prompt, response):
    return {'score': 0.5, 'step_scores': [0.1, 0.9], 'step_ends': [0, len(response) - 1], 'info': {'why': 'x'}}

def early(prompt, response):
    return {'score': 1.0, 'step_scores': [2.0], 'step_ends': [1]}

def logged(completions, log_extra, **kwargs):
    log_extra('verdict', ['fine' for _ in completions])
    return [0.25 for _ in completions]
"""


def test_a_route_passes_its_parts_whole_result_and_a_mix_keeps_step_rewards_and_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A route or mix kept only its parts' float: the per-step rewards (PPO's token rewards) and info
    (verl's extra keys, TRL's log_extra, a judge's verdict) a part returned were lost."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parts.py").write_text(STEPS_FILE)

    def score(spec, response: str = "abcd", metadata=None) -> RewardResult:
        with RewardRunner(load_reward_spec(spec), 5.0, 1) as runner:
            result = runner.score("q", response, "abcd", metadata or {"task": "math"})
        assert result.ok, result.failure
        return result

    direct = score("parts.py:steps")
    route = score({"route": "task", "routes": {"math": "parts.py:steps", "code": "parts.py:steps"}})
    assert (route.reward, route.steps, route.info) == (direct.reward, direct.steps, direct.info)
    assert route.steps == StepScores((0.1, 0.9), (0, 3)) and route.info == {"why": "x"}

    # every part at the same step_ends: the steps weighted like the scores; each part's info under mix.I/
    same = score({"mix": [{"fn": "parts.py:steps", "weight": 0.5}, {"fn": "parts.py:steps", "weight": 2.0}]})
    assert same.reward == pytest.approx(1.25) and same.steps.ends == (0, 3)
    assert same.steps.scores == pytest.approx((0.25, 2.25))
    assert same.info == {"mix.0/why": "x", "mix.1/why": "x"}

    # other ends are kept beside them; a part without steps counts at the last character
    mixed = score(
        {
            "mix": [
                {"fn": "parts.py:steps", "weight": 1.0},
                {"fn": "parts.py:early", "weight": 0.5},
                {"fn": "rewards.rule:exact_match", "weight": 3.0},
                {"fn": "parts.py:logged", "weight": 4.0},
            ]
        }
    )
    assert mixed.reward == pytest.approx(0.5 + 0.5 + 3.0 + 1.0)
    assert mixed.steps.ends == (0, 1, 3) and mixed.steps.scores == pytest.approx((0.1, 1.0, 0.9 + 3.0 + 1.0))
    assert mixed.info == {"mix.0/why": "x", "mix.3/verdict": "fine"}
    assert score({"mix": [{"fn": "rewards.rule:exact_match", "weight": 2.0}]}).steps is None  # a plain number


def test_an_async_mix_keeps_its_parts_step_rewards_and_info():
    async def judge(prompt, response):
        return {"score": 1.0, "info": {"judge": "[[8]]"}}

    def prm(prompt, response):
        return {"score": 0.5, "step_scores": [0.5], "step_ends": [len(response) - 1]}

    value = asyncio.run(WeightedSum([(judge, 0.5), (prm, 1.0)])("q", "ab", None, {}))
    assert value == {"score": 1.0, "step_scores": [1.0], "step_ends": [1], "info": {"mix.0/judge": "[[8]]"}}
    routed = asyncio.run(RouteByField("task", {"chat": judge})("q", "ab", None, {"task": "chat"}))
    assert routed == {"score": 1.0, "info": {"judge": "[[8]]"}}


def test_a_part_returning_a_many_element_array_is_named():
    """float() of the part's value was outside the error wrapping: the failure named the whole mix."""

    def vector(prompt, response):
        return np.array([1.0, 2.0])

    with pytest.raises(RewardChildError, match=r"^reward .*vector returned an unusable ndarray: "):
        WeightedSum([(half, 1.0), (vector, 1.0)])("q", "r", None, {})
    with pytest.raises(RewardChildError, match=r"^reward .*vector returned an unusable ndarray: "):
        RouteByField("task", default=vector)("q", "r", None, {})


EXITING_PART = """
import asyncio, os, sys
from rewards.mix import WeightedSum
from rewards.runner import RewardResult, RewardRunner, StepScores

async def judge(prompt, response):
    await asyncio.sleep(0)
    return 1.0

def hard(prompt, response):
    os._exit(7)

def soft(prompt, response):
    sys.exit(3)

for part in (hard, soft):
    with RewardRunner(WeightedSum([(judge, 1.0), (part, 1.0)]), timeout_s=10, max_concurrency=2) as runner:
        first, second = runner.score("p", "a"), runner.score("p", "b")  # the runner serves on after an exit
        print(part.__name__, "|", first.failure, "|", second.failure, flush=True)
print("still running", flush=True)
"""


def test_an_exit_in_a_sync_part_of_an_async_mix_fails_the_call_naming_the_part(tmp_path: Path):
    """Such a part runs on asyncio's threads (asyncio_N), which the exit guard did not know: an
    os._exit there ended the process, the whole job, without a word."""
    done = run_until_still_running(tmp_path / "exiting_part.py", EXITING_PART)
    lines = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    assert set(lines) == {"hard", "soft"}
    for name, code in (("hard", "os._exit(7)"), ("soft", "3")):
        first, second = lines[name].split(" | ")
        assert first == second and f"child reward __main__.{name} exited ({code})" in first, lines[name]
