"""What a reward does to its call must fail that call alone, naming the cause: an exception whose
`__str__` raises, a KeyboardInterrupt, an async reward that stops its event loop, a message that
would forge log lines. Found by fuzzing the real RewardRunner and GroupScorer."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from rewards.group import GroupCall, GroupScorer
from rewards.mix import WeightedSum
from rewards.runner import RewardRunner


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


class Unreadable:
    """A returned value whose __float__ and __repr__ raise KeyboardInterrupt."""

    def __float__(self) -> float:
        raise KeyboardInterrupt

    def __repr__(self) -> str:
        raise KeyboardInterrupt


class CustomBase(BaseException):
    pass


FORGED = "\x1b[31mRED\nFORGED: step 999 reward 1.000"


def _items(responses: list[str]) -> list[tuple]:
    return [("p", r, "a", {}) for r in responses]


# --- 1. sync rewards: any exception fails its call; nothing is counted as hung -------------------


def test_an_exception_whose_str_raises_fails_its_call_and_keeps_every_worker():
    def reward(prompt, response):
        if response == "boom":
            raise Unprintable()
        return 1.0

    with RewardRunner(reward, timeout_s=0.5, max_concurrency=1) as runner:
        # more than 4 * max_concurrency + 1 raises: all workers used to be written off as hung
        for _ in range(7):
            result = runner.score("p", "boom")
            assert result.reward is None
            assert "raised Unprintable: <its message could not be printed: RuntimeError> (at " in result.failure
            assert result.latency_s < 0.4 and runner.hung_calls == 0
        assert runner.score("p", "fine").reward == 1.0


@pytest.mark.parametrize(
    ("raised", "shown"),
    [(KeyboardInterrupt, "raised KeyboardInterrupt (at "), (CustomBase("why"), "raised CustomBase: why (at ")],
)
def test_base_exceptions_from_a_sync_reward_fail_only_their_call(raised: BaseException, shown: str):
    def reward(prompt, response):
        if response == "raise":
            raise raised
        return Unreadable() if response == "unreadable" else 1.0

    with RewardRunner(reward, timeout_s=0.5, max_concurrency=1) as runner:
        for _ in range(6):
            assert shown in runner.score("p", "raise").failure
            unreadable = runner.score("p", "unreadable").failure
            assert "returned a value of type Unreadable that could not be read: KeyboardInterrupt" in unreadable
        assert runner.score("p", "fine").reward == 1.0 and runner.hung_calls == 0


# --- 2. group rewards --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "shown"),
    [
        (KeyboardInterrupt(), "group reward g raised KeyboardInterrupt"),
        (Unprintable(), "group reward g raised Unprintable: <its message could not be printed: RuntimeError>"),
        (CustomBase(), "group reward g raised CustomBase"),
        (TimeoutError("mine"), "group reward g raised TimeoutError: mine"),  # not past reward.timeout_s
    ],
)
def test_a_group_reward_that_raises_any_exception_fails_its_group_not_as_a_timeout(raised, shown):
    def sync_group(prompt, responses):
        raise raised

    async def async_group(prompt, responses):
        raise raised

    for fn in (sync_group, async_group):
        scorer = GroupScorer(GroupCall(fn, "g"), timeout_s=2, max_concurrency=1)
        started = time.monotonic()
        (failed,) = scorer.score([_items(["a", "b"])])
        assert [r.failure for r in failed] == [shown, shown]
        assert time.monotonic() - started < 1.5 and scorer.hung == 0
        scorer.close()


def test_an_async_group_reward_that_stops_its_loop_fails_its_group_and_the_loop_serves_on():
    async def group(prompt, responses):
        if "stop" in responses:
            asyncio.get_running_loop().stop()
            await asyncio.sleep(0.01)
        return [1.0] * len(responses)

    scorer = GroupScorer(GroupCall(group, "g"), timeout_s=1, max_concurrency=1)
    (stopped,) = scorer.score([_items(["stop", "b"])])
    assert all("group reward g stopped the event loop" in r.failure for r in stopped)
    for _ in range(2):
        (fine,) = scorer.score([_items(["a", "b"])])
        assert [r.reward for r in fine] == [1.0, 1.0]
    scorer.close()


# --- 3. async rewards --------------------------------------------------------------------------


def test_an_async_reward_raising_keyboard_interrupt_fails_its_call_and_the_loop_serves_on():
    async def reward(prompt, response):
        if response == "raise":
            raise KeyboardInterrupt
        if response == "task":  # from a task of its own, awaited
            await asyncio.create_task(reward(prompt, "raise"))
        if response == "unreadable":
            return Unreadable()
        return 1.0

    with RewardRunner(reward, timeout_s=1, max_concurrency=2) as runner:
        for response in ("raise", "task", "raise"):
            result = runner.score("p", response)
            assert "raised KeyboardInterrupt (at " in result.failure and result.latency_s < 0.5
        assert "type Unreadable that could not be read: KeyboardInterrupt" in runner.score("p", "unreadable").failure
        assert runner.score("p", "fine").reward == 1.0


def test_an_async_reward_that_stops_its_event_loop_fails_only_its_call():
    async def reward(prompt, response):
        if response == "stop":
            asyncio.get_running_loop().stop()
            await asyncio.sleep(0.01)
        return 1.0

    with RewardRunner(reward, timeout_s=1, max_concurrency=2) as runner:
        stopped = runner.score("p", "stop")
        assert stopped.reward is None and "stopped the event loop" in stopped.failure
        assert not stopped.interrupted and stopped.latency_s < 0.5
        results = [f.result() for f in [runner.submit("p", r) for r in ("a", "stop", "b", "c")]]
        assert [r.reward for r in results] == [1.0, None, 1.0, 1.0]
        assert runner.score("p", "fine").reward == 1.0


# --- 4. a reward's text cannot forge log lines ---------------------------------------------------


def test_a_local_rewards_failure_text_is_escaped():
    class Forger:
        def __repr__(self) -> str:
            return FORGED

    def reward(prompt, response):
        if response == "repr":
            return Forger()
        raise ValueError(FORGED)

    async def group(prompt, responses):
        raise ValueError(FORGED)

    escaped = "\\x1b[31mRED\\nFORGED: step 999 reward 1.000"
    with RewardRunner(reward, timeout_s=5, max_concurrency=1) as runner:
        raised = runner.score("p", "r").failure
        assert f"raised ValueError: {escaped} (at " in raised
        assert f"returned Forger {escaped[:80]}" in runner.score("p", "repr").failure
    with RewardRunner(WeightedSum([(reward, 1.0)]), timeout_s=5, max_concurrency=1) as runner:
        in_mix = runner.score("p", "r").failure
        assert f"raised ValueError: {escaped}" in in_mix
    scorer = GroupScorer(GroupCall(group, "g"), timeout_s=5, max_concurrency=1)
    in_group = scorer.score([_items(["a"])])[0][0].failure
    scorer.close()
    assert in_group == f"group reward g raised ValueError: {escaped}"
    for failure in (raised, in_mix, in_group):
        assert "\x1b" not in failure and "\n" not in failure


# --- 5. per-step rewards as numpy or torch scalars -----------------------------------------------


@pytest.mark.parametrize("step", [np.float32(1.0), np.float64(0.5), np.int64(1), torch.tensor(0.25)])
def test_numpy_and_torch_step_scores_are_accepted_as_the_score_is(step):
    def reward(prompt, response):
        return {"score": np.float32(1.0), "step_scores": [step, 0.0], "step_ends": [0, np.int64(1)]}

    with RewardRunner(reward, timeout_s=5, max_concurrency=1) as runner:
        result = runner.score("p", "ab")
    assert result.failure is None and result.reward == 1.0
    assert result.steps is not None and result.steps.scores == (float(step), 0.0) and result.steps.ends == (0, 1)


def test_step_scores_that_are_no_real_number_are_still_refused():
    bad = [np.float32("nan"), np.complex64(1), True, "1", torch.tensor([1.0, 2.0])]
    for step in bad:

        def reward(prompt, response, step=step):
            return {"score": 1, "step_scores": [step], "step_ends": [0]}

        with RewardRunner(reward, timeout_s=5, max_concurrency=1) as runner:
            failure = runner.score("p", "ab").failure
        assert failure is not None and "step_scores[0] = " in failure and "is not a finite number" in failure
