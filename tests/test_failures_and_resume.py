"""Loud failures and resumable metrics without a job (issue 20, items 2 and 4): the failure
reason keys, the failed-share watch that stops a job, the CLI's exit code, and the metrics
series a resumed run continues without duplicated steps. The end-to-end versions are in
tests/test_train_e2e.py (an all-failing reward) and tests/test_april.py (SIGKILL + resume)."""

from __future__ import annotations

import json
import math

import pytest

from slime import cli
from slime.config import LoggingConfig, load_config
from slime.metrics import FailureWatch, MetricsLogger, TooManyFailures, trailing_mean
from slime.sample import failure_key

QUIET = LoggingConfig(tensorboard=False, plot=False, progress=False)


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        (
            "reward function r.py:reward raised ValueError: boom 17 (at r.py:3)",
            "reward function r.py:reward raised ValueError",
        ),
        ("reward function m:f timed out after 30s", "reward function m:f timed out"),
        (
            "reward function /tmp/x/my_reward.py:score raised KeyError: 3",
            "reward function my_reward.py:score raised KeyError",
        ),
        ("reward function m:f returned None (a missing return statement?)", "reward function m:f returned"),
        ("env e.py:Maze raised KeyError: 'x'", "env e.py:Maze raised KeyError"),
        # a group reward's kinds too; the wrong-count one was cut at 80 characters, mid-sentence
        ("group reward g.py:rank returned 1 rewards for a group of 4 responses", "group reward g.py:rank returned"),
        ("group reward g.py:rank took longer than reward.timeout_s=5", "group reward g.py:rank took longer"),
        (
            "group reward g.py:rank gave None for this response: it does not score it",
            "group reward g.py:rank gave None",
        ),
        # a spec-dict reward is named by its repr (spaces, colons, a judge template's braces): counted by
        # the functions it names and the kind, not cut at the repr's first colon into one bucket for all
        (
            "reward function {'fn': 'rewards.judge:llm_judge', 'kwargs': {'model_dir': 'tiny', 'template': "
            "'Q: {prompt}\\nScore:'}} raised JudgeParseError: no score (at judge.py:269)",
            "reward function rewards.judge:llm_judge raised JudgeParseError",
        ),
        (
            "reward function {'fn': 'rewards.judge:llm_judge', 'kwargs': {'model_dir': 'tiny'}} timed out after 60s",
            "reward function rewards.judge:llm_judge timed out",
        ),
        (
            "reward function {'mix': [{'fn': 'rewards.rule:math_answer', 'weight': 0.8}, {'fn': 'rewards.rule:f1', "
            "'weight': 0.2}]} raised RewardChildError: child reward x raised ValueError: y",
            "reward function rewards.rule:math_answer+rewards.rule:f1 raised RewardChildError",
        ),
        ("placing per-step rewards on tokens failed: ValueError: x", "placing per-step rewards on tokens failed"),
        ("first line: detail\nsecond line", "first line"),
        ("", "no reason given"),
        (None, "no reason given"),
    ],
)
def test_failure_key_drops_the_per_sample_details(reason, key):
    assert failure_key(reason) == key


def _step(failed: int, samples: int, reason: str = "reward function f raised ValueError: boom") -> dict:
    by_reason = {failure_key(reason): {"count": failed, "example_id": "s1", "example": reason}} if failed else {}
    return {"failed_samples": failed, "samples": samples, "failures_by_reason": by_reason}


def test_failure_watch_judges_a_full_window_and_names_the_commonest_reasons():
    said: list[str] = []
    watch = FailureWatch(max_share=0.5, window=3, say=said.append)
    watch.observe(_step(9, 9))
    watch.check()  # one step of three: not judged yet
    watch.observe(_step(9, 9))
    watch.check()
    assert said == [
        "failed sample (reward function f raised ValueError): reward function f raised ValueError: boom [sample s1]"
    ]
    watch.observe(_step(0, 9))
    with pytest.raises(TooManyFailures) as err:
        watch.check()
    message = str(err.value)
    assert "18 of 27 samples failed over the last 3 steps (67% > reward.max_failed_share=0.5)" in message
    assert "18x reward function f raised ValueError" in message and "e.g. sample s1: " in message


def test_failure_watch_names_the_reasons_of_its_window_only():
    """The reasons counted the whole run while the header counted the window: they added up to more."""
    watch = FailureWatch(max_share=0.5, window=2, say=lambda _: None)
    watch.observe(_step(9, 9, "env e raised ValueError: old"))
    watch.observe(_step(6, 9, "env call exceeded env.step_timeout_s=2"))
    watch.observe(_step(4, 9, "env e raised RuntimeError: new"))
    with pytest.raises(TooManyFailures) as err:
        watch.check()
    message = str(err.value)
    assert "10 of 18 samples failed over the last 2 steps" in message
    assert "6x env call exceeded" in message and "4x env e raised RuntimeError" in message
    assert "ValueError" not in message  # its step left the window


def test_failure_watch_passes_at_the_threshold_and_judges_a_short_run_at_its_end():
    watch = FailureWatch(max_share=0.5, window=3, say=lambda _: None)
    for failed in (9, 0, 9, 0):  # the first step leaves the window: (0, 9, 0) is 9 of 27
        watch.observe(_step(failed, 9))
    watch.check()
    watch.observe(_step(4, 9))
    watch.check()  # (9, 0, 4): 13 of 27, not above a half
    short = FailureWatch(max_share=0.5, window=3, say=lambda _: None)
    short.observe(_step(5, 9))
    short.check()
    with pytest.raises(TooManyFailures, match="5 of 9 samples failed over the last 1 steps"):
        short.check(last_step=True)
    never = FailureWatch(max_share=1.0, window=1, say=lambda _: None)
    never.observe(_step(9, 9))
    never.check(last_step=True)  # 1.0 never stops


def test_cli_exits_1_and_prints_the_reasons_when_too_many_samples_fail(monkeypatch, capsys, tmp_path):
    import slime.train

    def failing_train(cfg):
        raise TooManyFailures("9 of 9 samples failed ... 9x reward function f raised ValueError")

    monkeypatch.setattr(slime.train, "train", failing_train)
    assert cli.main(["train", f"output_dir={tmp_path}"]) == 1
    assert "slime: 9 of 9 samples failed" in capsys.readouterr().err


def test_config_takes_the_failure_and_checkpoint_settings_and_names_bad_ones():
    cfg = load_config(None, [])
    assert cfg.reward.max_failed_share == 0.5 and cfg.reward.failed_window_steps == 3
    assert cfg.checkpoint.every_seconds == 300.0  # periodic by default: a crash loses at most ~5 minutes
    with pytest.raises(ValueError, match="reward.max_failed_share"):
        load_config(None, ["reward.max_failed_share=1.5"])
    with pytest.raises(ValueError, match="every_seconds"):
        load_config(None, ["checkpoint.every_seconds=-1"])


def test_a_resumed_run_continues_the_metrics_series_without_duplicated_steps(tmp_path):
    rows = [{"step": s, "wall_seconds": 10.0 * (s + 1), "reward_mean": s / 10} for s in range(5)]
    # Steps 3 and 4 were logged after the last checkpoint (it holds steps 0-2); the crash tore a line.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "wal')
    logger = MetricsLogger(tmp_path, QUIET, total_steps=6, start_step=3)
    assert [h["step"] for h in logger.history] == [0, 1, 2]
    logger.log(3, {"reward_mean": 0.9})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert lines[3]["wall_seconds"] >= 30.0  # the clock goes on from the last kept step
    assert lines[3]["reward_mean"] == 0.9

    fresh = MetricsLogger(tmp_path, QUIET, total_steps=2, start_step=0)  # a run from step 0 starts a new series
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_plots_trailing_mean_skips_steps_without_a_reward():
    """A step whose samples all failed (reward NaN) blanked the next 10 points of the line."""
    nan = float("nan")
    smooth = trailing_mean([nan, 1.0, nan, 0.0, 0.5], window=3)
    assert math.isnan(smooth[0])
    assert smooth[1:] == [1.0, 1.0, 0.5, 0.25]


@pytest.mark.slow
def test_after_a_resume_no_token_is_generated_before_the_checkpoints_weights_arrive(
    tmp_path, tiny_model_dir, monkeypatch
):
    """A resumed job's workers started unpaused on the model directory's weights, labelled with the
    checkpoint's version, and leased the stored partials at once: until the restore push, their tokens
    were the base model's (a vLLM trial found 162 such tokens labelled v4 after a worker's kill -9 and
    the job's restart). The push is delayed here to make that window certain."""
    import threading
    import time

    from slime.rollout.worker import RolloutWorker
    from slime.train import train
    from tests.helpers import TINY_JOB

    base = [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "cluster.launcher=local", *TINY_JOB]
    base += ["april.enabled=true", "rollout.max_new_tokens=48", "checkpoint.every_steps=1"]
    train(load_config(None, [*base, "steps=2"]))
    pushed, early = threading.Event(), []
    update_weights, absorb = RolloutWorker.update_weights, RolloutWorker._absorb

    def slow_update(self, handle):
        time.sleep(2.0)
        try:
            return update_weights(self, handle)
        finally:
            pushed.set()

    def watched_absorb(self, chunks, wait=False):
        if not pushed.is_set():
            early.extend(len(c.token_ids) for c in chunks if c.token_ids)
        return absorb(self, chunks, wait)

    monkeypatch.setattr(RolloutWorker, "update_weights", slow_update)
    monkeypatch.setattr(RolloutWorker, "_absorb", watched_absorb)
    history = train(load_config(None, [*base, "steps=3", "resume=auto"]))
    assert history[-1]["step"] == 2
    assert pushed.is_set() and not early, f"{sum(early)} tokens generated before the checkpoint's weights arrived"
