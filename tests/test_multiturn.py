"""Multi-turn rollout on the real worker, engine, tiny model and Redis: a scripted env exchange whose
token arrays, loss mask and logprobs line up exactly with a turn-by-turn reference run of the engine;
APRIL aborts mid-turn, between a model turn and its observation, and after an observation resume in
the right turn; every limit ends the episode with a status naming it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from slime.algorithms.batch import collate
from slime.buffer import TrajectoryStore
from slime.config import ConfigError, load_config
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.model import load_model, load_tokenizer
from slime.rollout.multiturn import EnvContractError, MultiTurnRollout, _Episode
from slime.sample import Sample, Status, failure_key
from tests.helpers import wait_for

PROMPT = [6, 7, 77, 61, 86]  # "ab*3="
TURN_TOKENS = 5


class ScriptedEnv:
    """Observation "[obs k]" after model turn k; done after `done_at` turns (0: never); 0.25 per step."""

    def __init__(
        self, done_at: int = 0, sleep_s: float = 0.0, observation: str | None = None, fail_at: int = 0, exit_at: int = 0
    ):
        self.done_at, self.sleep_s, self.observation, self.fail_at = done_at, sleep_s, observation, fail_at
        self.exit_at = exit_at
        self.turn = 0

    def reset(self, sample: Sample) -> str:
        self.turn = 0
        return ""

    def step(self, action: str):
        self.turn += 1
        time.sleep(self.sleep_s)
        if self.turn == self.fail_at:
            raise RuntimeError("scripted failure")
        if self.turn == self.exit_at:
            raise SystemExit("usage: tool [-h]")  # a wrapped command-line tool's argparse error
        observation = self.observation if self.observation is not None else f"[obs {self.turn}]"
        return observation, 0.25, self.turn == self.done_at, {"turn": self.turn, "action": action}


class AsyncScriptedEnv(ScriptedEnv):
    """ScriptedEnv with `async def` reset and step (an env that awaits an external API)."""

    async def reset(self, sample: Sample) -> str:
        await asyncio.sleep(0)
        return ScriptedEnv.reset(self, sample)

    async def step(self, action: str):
        await asyncio.sleep(0.01)
        return ScriptedEnv.step(self, action)


class SnapshotEnv(ScriptedEnv):
    """ScriptedEnv that keeps a snapshot: a resumed episode is restored from it, never replayed (a
    replayed step would record "replayed" in its info)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tag = "fresh"

    def step(self, action: str):
        observation, reward, done, info = super().step(action)
        return observation, reward, done, {**info, "tag": self.tag}

    def snapshot(self) -> dict:
        return {"turn": self.turn, "tag": self.tag}

    def restore(self, sample: Sample, snapshot: dict) -> None:
        self.turn, self.tag = snapshot["turn"], f"restored from {snapshot['tag']}"


class CountingSnapshotEnv(SnapshotEnv):
    """SnapshotEnv that writes a line per step it really runs (a restore runs none) to ``log``: a
    file, since the plugin loader may import this module apart from pytest's copy."""

    def __init__(self, log: str, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def reset(self, sample: Sample) -> str:
        self.sample_id = sample.id
        return super().reset(sample)

    def step(self, action: str):
        with open(self.log, "a") as f:
            f.write(self.sample_id + "\n")
        return super().step(action)


class HangsOnceEnv(ScriptedEnv):
    """ScriptedEnv whose first step in this process hangs for `hang_s` (the others take 0.05 s)."""

    steps = 0
    lock = threading.Lock()

    def __init__(self, hang_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.hang_s = hang_s

    def step(self, action: str):
        with HangsOnceEnv.lock:
            HangsOnceEnv.steps += 1
            first = HangsOnceEnv.steps == 1
        time.sleep(self.hang_s if first else 0.05)
        return super().step(action)


def obs_ids(tokenizer, k: int) -> list[int]:
    return tokenizer(f"[obs {k}]", add_special_tokens=False)["input_ids"]


def reference_episode(model_dir, turns: int) -> tuple[list[int], list[float], list[int]]:
    """The exchange driven by hand on a standalone engine: greedy model turns of TURN_TOKENS tokens,
    each followed by the scripted observation's tokens (loss mask 0, logprob 0)."""
    tokenizer = load_tokenizer(model_dir)
    engine = BuiltinEngine(load_model(model_dir), max_running_requests=2)
    ids: list[int] = []
    lps: list[float] = []
    mask: list[int] = []
    for k in range(1, turns + 1):
        params = SamplingParams(temperature=0, max_new_tokens=len(ids) + TURN_TOKENS, stop_token_ids=[])
        engine.add_request(GenerationRequest("ref", PROMPT, params, list(ids)))
        while engine.has_unfinished():
            for chunk in engine.step():
                ids += chunk.token_ids
                lps += chunk.logprobs
                mask += [1] * len(chunk.token_ids)
        if k < turns:
            o = obs_ids(tokenizer, k)
            ids, lps, mask = ids + o, lps + [0.0] * len(o), mask + [0] * len(o)
    return ids, lps, mask


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return reference_episode(tiny_model_dir, turns=3)


def job_config(buffer: TrajectoryStore, tmp_path, *overrides: str):
    return load_config(
        None,
        [
            f"job_name={buffer.job}",
            f"output_dir={tmp_path}",
            "rollout.temperature=0",
            "rollout.ignore_eos=true",
            "rollout.max_new_tokens=80",
            "rollout.chunk_tokens=2",
            "rollout.max_running_requests=8",
            "env.plugin=tests.test_multiturn:ScriptedEnv",
            f"env.max_turn_tokens={TURN_TOKENS}",
            "env.max_turns=6",
            "env.kwargs={done_at: 3}",
            *overrides,
        ],
    )


def run_worker(cfg, model_dir, redis_url, buffer, groups, timeout=120):
    from slime.rollout import RolloutWorker

    worker = RolloutWorker(cfg, str(model_dir), redis_url, "w-mt")
    try:
        wait_for(lambda: worker.error or buffer.counts()["groups_ready"] == len(groups), timeout, "episodes to finish")
        assert worker.error is None, worker.error
        return worker, [s for gid in groups for s in buffer.get_group(gid)]
    finally:
        worker.stop()


def assert_matches_reference(sample: Sample, reference) -> None:
    ids, lps, mask = reference
    assert sample.response_ids.tolist() == ids
    assert sample.loss_mask.tolist() == mask
    np.testing.assert_allclose(sample.logprobs, lps, atol=1e-4)


def test_scripted_exchange_lines_up_token_for_token(buffer, redis_url, tiny_model_dir, tmp_path, reference):
    cfg = job_config(buffer, tmp_path)
    groups = [buffer.add_group(PROMPT, 2, 80, {"label": "ababab"})]
    worker, samples = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    # Turns 2 and 3 of both episodes fed only their observation onto the kept cache of the turn
    # before (rollout.kept_kv_tokens); the reference prefills every turn, and the tokens agree.
    health = worker.health()
    assert health["kv_resumes"] == 4 and health["kv_resumed_tokens"] >= 2 * (2 * len(PROMPT) + 15)
    # Each episode's last turn kept its cache until the episode ended; then the worker dropped it.
    assert worker.engine.health()["kv_kept_requests"] == 0
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = BuiltinEngine(load_model(tiny_model_dir))
    for s in samples:
        assert s.status == Status.COMPLETED and s.reward == pytest.approx(0.75)
        assert s.metadata["env_turns"] == 3 and s.metadata["env_end"] == "done"
        assert [i["turn"] for i in s.metadata["env_infos"]] == [1, 2, 3]
        # Layout: 5 model tokens, "[obs 1]", 5 model tokens, "[obs 2]", 5 model tokens.
        o1, o2 = obs_ids(tokenizer, 1), obs_ids(tokenizer, 2)
        expected_mask = [1] * 5 + [0] * len(o1) + [1] * 5 + [0] * len(o2) + [1] * 5
        assert s.loss_mask.tolist() == expected_mask
        assert s.response_ids[5 : 5 + len(o1)].tolist() == o1
        assert s.response_ids[10 + len(o1) : 10 + len(o1) + len(o2)].tolist() == o2
        assert len(s.response_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
        model = s.loss_mask == 1
        assert np.all(s.logprobs[~model] == 0) and np.all(s.logprobs[model] < 0)
        # The stored model tokens are the engine's own, with its logprobs: the reference run agrees,
        # and one forward pass over prompt + response scores them the same.
        assert_matches_reference(s, reference)
        scored = np.array(engine.score_logprobs(PROMPT, s.response_ids.tolist()))
        np.testing.assert_allclose(s.logprobs[model], scored[model], atol=1e-3)


def _seed_partials(buffer: TrajectoryStore, reference, cuts: list[int]) -> list[str]:
    """One group per cut whose one sample holds the reference's first `cut` tokens, as an aborted
    partial (leased all at once: a released sample goes to the resume queue, which lease pops first)."""
    groups = [buffer.add_group(PROMPT, 1, 80, {"label": "ababab"}) for _ in cuts]
    samples = buffer.lease("setup", len(cuts))
    assert [s.group_id for s in samples] == groups
    ids, lps, mask = reference
    for sample, upto in zip(samples, cuts):
        buffer.append_chunk(sample.id, "setup", ids[:upto], lps[:upto], 0, loss_mask=mask[:upto])
        buffer.release(sample.id, "setup")
        assert buffer.get_sample(sample.id).status == Status.ABORTED
    return groups


def test_aborted_partials_resume_in_the_right_turn(buffer, redis_url, tiny_model_dir, tmp_path, reference):
    tokenizer = load_tokenizer(tiny_model_dir)
    o1 = len(obs_ids(tokenizer, 1))
    cuts = {
        "mid_turn_1": 3,  # the model continues turn 1 for 2 more tokens
        "turn_1_done_no_obs": 5,  # between the model's turn end and the env's observation
        "mid_obs_done": 5 + o1,  # observation 1 stored: turn 2 starts; the env replays turn 1
        "mid_turn_2": 5 + o1 + 2,
    }
    groups = dict(zip(cuts, _seed_partials(buffer, reference, list(cuts.values()))))
    cfg = job_config(buffer, tmp_path)
    _, _ = run_worker(cfg, tiny_model_dir, redis_url, buffer, list(groups.values()))
    for name, gid in groups.items():
        (s,) = buffer.get_group(gid)
        assert s.status == Status.COMPLETED, name
        assert_matches_reference(s, reference)
        # The env's step count survived the abort: three turns, observations numbered 1 and 2, once each.
        assert s.metadata["env_turns"] == 3 and s.reward == pytest.approx(0.75), name


@pytest.mark.parametrize("snapshot_matches", [True, False])
def test_resume_restores_the_env_snapshot_stored_with_the_observation(
    buffer, redis_url, tiny_model_dir, tmp_path, reference, snapshot_matches
):
    """A partial whose last observation was stored with an env snapshot resumes from that snapshot
    (no step runs again); a snapshot of another transcript length is ignored and the env replays."""
    tokenizer = load_tokenizer(tiny_model_dir)
    upto = 5 + len(obs_ids(tokenizer, 1)) + 2  # inside model turn 2
    (gid,) = [buffer.add_group(PROMPT, 1, 80, {"label": "ababab"})]
    (sample,) = buffer.lease("setup", 1)
    ids, lps, mask = reference
    at_length = 5 + len(obs_ids(tokenizer, 1)) + (0 if snapshot_matches else 1)
    state = {"at_length": at_length, "turns": 1, "env_return": 0.25, "infos": [{"turn": 1}]}
    buffer.append_chunk(sample.id, "setup", ids[:5], lps[:5], 0, loss_mask=1)
    buffer.append_chunk(
        sample.id,
        "setup",
        ids[5:upto],
        lps[5:upto],
        0,
        loss_mask=mask[5:upto],
        stored_length=5,
        env_state=json.dumps({**state, "state": {"turn": 1, "tag": "turn-1 snapshot"}}),
    )
    buffer.release(sample.id, "setup")
    assert json.loads(buffer.env_state(sample.id))["state"]["tag"] == "turn-1 snapshot"
    cfg = job_config(buffer, tmp_path, "env.plugin=tests.test_multiturn:SnapshotEnv", "env.turn_rewards=true")
    run_worker(cfg, tiny_model_dir, redis_url, buffer, [gid])
    (s,) = buffer.get_group(gid)
    assert s.status == Status.COMPLETED and s.metadata["env_turns"] == 3 and s.reward == pytest.approx(0.75)
    assert_matches_reference(s, reference)
    # env.turn_rewards: each step's 0.25 on the last token of the turn it answered, restored ones too
    run_ends = np.flatnonzero((s.loss_mask == 1) & (np.append(s.loss_mask[1:], 0) == 0))
    assert len(run_ends) == 3 and np.flatnonzero(s.token_rewards).tolist() == run_ends.tolist()
    assert s.token_rewards[run_ends].tolist() == [0.25, 0.25, 0.25]
    stats = buffer.stats()
    tags = [i["tag"] for i in s.metadata["env_infos"] if "tag" in i]
    if snapshot_matches:
        assert tags == ["restored from turn-1 snapshot"] * 2
        assert stats.get("env_snapshot_restores") == 1 and not stats.get("env_replays")
    else:
        assert tags == ["fresh"] * 3  # turn 1 replayed, then turns 2 and 3
        assert stats.get("env_replays") == 1 and not stats.get("env_snapshot_restores")
    assert buffer.env_state(sample.id) is None  # a finished episode keeps no snapshot


def test_every_observation_is_stored_with_its_snapshot(buffer, redis_url, tiny_model_dir, tmp_path):
    """Live: while an episode runs, the stored snapshot always belongs to the stored transcript."""
    from slime.rollout import RolloutWorker

    cfg = job_config(
        buffer, tmp_path, "env.plugin=tests.test_multiturn:SnapshotEnv", "env.kwargs={done_at: 3, sleep_s: 0.3}"
    )
    (gid,) = [buffer.add_group(PROMPT, 1, 80, {"label": "ababab"})]
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w-snap")
    seen = set()
    (sample_id,) = [s.id for s in buffer.get_group(gid)]
    try:
        deadline = time.time() + 60
        while buffer.counts()["groups_ready"] == 0 and time.time() < deadline:
            # The snapshot first: transcript and snapshot are written in one step, so a transcript read
            # after its snapshot can only be as new or newer (read the other way round, a turn that
            # lands between the two reads pairs an old transcript with a new snapshot).
            raw = buffer.env_state(sample_id)
            (s,) = buffer.get_group(gid)
            if raw is not None and s.status != Status.COMPLETED:
                state = json.loads(raw)
                # The transcript may have grown past the snapshot (the next model turn), never fallen short.
                assert s.response_length >= state["at_length"] and s.loss_mask[state["at_length"] - 1] == 0
                assert state["state"]["turn"] == state["turns"]
                seen.add(state["turns"])
            time.sleep(0.05)
        assert worker.error is None, worker.error
    finally:
        worker.stop()
    assert seen == {1, 2}


def _wait_for_env_steps(worker, buffer: TrajectoryStore, stored: Callable[[int], bool]) -> None:
    """Until all four episodes wait on an env step with `stored(response_length)` tokens stored. An
    episode waits on the env in its reset too, before any token: a slow machine's first look can
    land there."""
    wait_for(
        lambda: (
            len(worker.multiturn.env_turn_ids()) == 4 and all(stored(s.response_length) for s in buffer.iter_samples())
        ),
        60,
        "all four episodes to wait on an env step",
    )


def test_live_abort_while_env_steps_run_resumes_exactly(buffer, redis_url, tiny_model_dir, tmp_path, reference):
    from slime.rollout import RolloutWorker

    cfg = job_config(buffer, tmp_path, "env.kwargs={done_at: 3, sleep_s: 0.4}")
    groups = [buffer.add_group(PROMPT, 2, 80, {"label": "ababab"}) for _ in range(2)]
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w-live")
    try:
        # Wait until every episode is inside an env step (model turn 1 done, no observation yet).
        _wait_for_env_steps(worker, buffer, lambda length: length == TURN_TOKENS)
        assert worker.abort_all() == 4
        stored = list(buffer.iter_samples())
        assert all(s.status == Status.ABORTED for s in stored)
        assert all(s.loss_mask.tolist() == [1] * TURN_TOKENS for s in stored)
        worker.resume()
        wait_for(lambda: worker.error or buffer.counts()["groups_ready"] == 2, 120, "resumed episodes to finish")
        assert worker.error is None, worker.error
    finally:
        worker.stop()
    for s in (s for gid in groups for s in buffer.get_group(gid)):
        assert s.status == Status.COMPLETED and s.metadata["env_turns"] == 3
        assert_matches_reference(s, reference)


def test_an_abort_stores_the_env_steps_that_returned_and_none_runs_twice(buffer, redis_url, tiny_model_dir, tmp_path):
    """An env step that had returned when the abort came, but that the generation loop had not
    collected yet, was dropped with the episode: the resumed episode ran that step a second time."""
    from slime.rollout import RolloutWorker

    log = tmp_path / "steps.log"
    cfg = job_config(
        buffer,
        tmp_path,
        "env.plugin=tests.test_multiturn:CountingSnapshotEnv",
        f"env.kwargs={{done_at: 3, sleep_s: 0.3, log: '{log}'}}",
    )
    groups = [buffer.add_group(PROMPT, 2, 80, {"label": "ababab"}) for _ in range(2)]
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w-answered")
    try:
        _wait_for_env_steps(worker, buffer, lambda length: length >= TURN_TOKENS)
        worker.paused.set()  # the loop collects no env result from here
        wait_for(lambda: all(ep.job.done() for ep in worker.multiturn.episodes.values()), 30, "the steps to return")
        assert worker.abort_all() == 4
        for s in buffer.iter_samples():  # each turn's observation is stored with it
            assert s.status == Status.ABORTED and s.loss_mask.tolist()[: TURN_TOKENS + 1] == [1] * TURN_TOKENS + [0]
        worker.resume()
        wait_for(lambda: worker.error or buffer.counts()["groups_ready"] == 2, 120, "resumed episodes to finish")
        assert worker.error is None, worker.error
    finally:
        worker.stop()
    samples = [s for gid in groups for s in buffer.get_group(gid)]
    assert all(s.status == Status.COMPLETED and s.metadata["env_turns"] == 3 for s in samples)
    assert sorted(Counter(log.read_text().split()).values()) == [3, 3, 3, 3]


def test_a_resumed_turn_that_spent_the_episode_budget_is_answered_as_the_uninterrupted_one(
    buffer, tiny_model_dir, tmp_path
):
    """A model turn cut short by env.max_episode_tokens is stepped by the env before the episode ends
    truncated. Resumed between that turn and its step, the episode ended without the step (one turn
    and its reward fewer), as the stored turn neither stopped nor filled max_turn_tokens."""
    cfg = job_config(buffer, tmp_path, "env.max_episode_tokens=20", "env.kwargs={done_at: 0}", "env.max_turns=50")
    tokenizer = load_tokenizer(tiny_model_dir)
    observation = obs_ids(tokenizer, 1)
    buffer.add_group(PROMPT, 1, 80, {"label": "ababab"})
    (sample,) = buffer.lease("w-budget", 1)
    second_turn = 20 - len(PROMPT) - TURN_TOKENS - len(observation)  # what the budget left it
    assert 0 < second_turn < TURN_TOKENS
    buffer.append_chunk(sample.id, "w-budget", [6] * TURN_TOKENS, [-0.5] * TURN_TOKENS, 0)
    buffer.append_chunk(sample.id, "w-budget", observation, [0.0] * len(observation), 0, loss_mask=0)
    buffer.append_chunk(sample.id, "w-budget", [7] * second_turn, [-0.5] * second_turn, 0)
    rollout = MultiTurnRollout(cfg.env, tokenizer, SamplingParams(max_new_tokens=80), buffer, "w-budget")
    try:
        rollout.begin(buffer.get_sample(sample.id))
        out = []
        wait_for(lambda: out.extend(rollout.poll(0)) or out, 30, "the resumed episode's first env work")
    finally:
        rollout.close()
    ((_, end),) = out
    assert (end.status, end.reason, end.turns) == (Status.TRUNCATED, "max_episode_tokens", 2)
    assert end.step_rewards == [0.25, 0.25]


@pytest.mark.parametrize(
    "overrides, status, reason, check",
    [
        (
            ["env.kwargs={done_at: 0}", "env.max_turns=2"],
            Status.TRUNCATED,
            "max_turns",
            lambda s: s.metadata["env_turns"] == 2 and int(np.sum(np.diff(s.loss_mask) == 1)) == 1,
        ),
        (["rollout.max_new_tokens=14"], Status.TRUNCATED, "max_new_tokens", lambda s: s.response_length <= 14),
        (
            ["env.max_episode_tokens=22", "env.kwargs={done_at: 0}", "env.max_turns=50"],
            Status.TRUNCATED,
            "max_episode_tokens",
            lambda s: len(PROMPT) + s.response_length <= 22 and "loss_masked" not in s.metadata,
        ),
        (
            ["env.kwargs={done_at: 0}", "env.max_turns=2", "env.truncated_episodes=mask"],
            Status.TRUNCATED,
            "max_turns",
            lambda s: (
                s.metadata["loss_masked"] == "truncated: max_turns" and collate([s], [0], pad_id=0).mask.sum() == 0
            ),
        ),
        (
            ["env.kwargs={done_at: 2, observation: 'a very long observation text'}", "env.max_observation_tokens=4"],
            Status.COMPLETED,
            "done",
            lambda s: s.loss_mask.tolist() == [1] * 5 + [0] * 4 + [1] * 5,
        ),
        (
            ["env.kwargs={done_at: 0, sleep_s: 3}", "env.step_timeout_s=0.5"],
            Status.FAILED,
            "env call exceeded env.step_timeout_s=0.5",
            lambda s: s.response_length == 5,
        ),
        (["env.kwargs={fail_at: 2}"], Status.FAILED, "RuntimeError: scripted failure", lambda s: s.response_length > 5),
        (["env.kwargs={exit_at: 2}"], Status.FAILED, "raised SystemExit: usage: tool", lambda s: s.response_length > 5),
        (["env.kwargs={observation: ''}"], Status.FAILED, "empty observation", lambda s: s.response_length == 5),
        (
            ["env.max_turn_tokens=480", "env.max_turn_seconds=0.1", "rollout.max_new_tokens=480"],
            Status.TRUNCATED,
            "max_turn_seconds",
            lambda s: s.response_length < 480,
        ),
        (
            ["env.kwargs={done_at: 0, sleep_s: 0.3}", "env.max_episode_seconds=0.5", "env.max_turns=50"],
            Status.TRUNCATED,
            "max_episode_seconds",
            lambda s: s.metadata["env_turns"] >= 1,
        ),
    ],
)
def test_limits_end_the_episode_and_say_which(
    buffer, redis_url, tiny_model_dir, tmp_path, overrides, status, reason, check
):
    cfg = job_config(buffer, tmp_path, *overrides)
    groups = [buffer.add_group(PROMPT, 1, cfg.rollout.max_new_tokens, {"label": "ababab"})]
    _, (s,) = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    assert s.status == status
    assert reason in (s.failure if status == Status.FAILED else s.metadata["env_end"])
    assert check(s), (s.response_length, s.loss_mask.tolist(), s.metadata)


def test_one_hung_env_call_fails_its_own_episode_only(buffer, redis_url, tiny_model_dir, tmp_path):
    """With one env thread, the calls queued behind a hung one used up their step_timeout_s in the
    queue: every episode of the worker failed, and kept failing while the hung thread held the slot."""
    HangsOnceEnv.steps = 0
    cfg = job_config(
        buffer,
        tmp_path,
        "env.plugin=tests.test_multiturn:HangsOnceEnv",
        "env.kwargs={done_at: 2, hang_s: 8}",
        "env.max_concurrency=1",
        "env.step_timeout_s=1",
    )
    groups = [buffer.add_group(PROMPT, 4, cfg.rollout.max_new_tokens, {"label": "ababab"})]
    _, samples = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    failed = [s for s in samples if s.status == Status.FAILED]
    assert len(failed) == 1 and "env call exceeded env.step_timeout_s=1" in failed[0].failure
    assert sorted(s.metadata.get("env_turns") for s in samples if s not in failed) == [2, 2, 2]


@pytest.mark.parametrize("budget", [60, 200])
def test_long_observations_keep_head_and_tail(buffer, redis_url, tiny_model_dir, tmp_path, budget):
    """The marker says how much was cut; where it would take over a quarter of the budget (33 of a
    character tokenizer's 60 tokens: 7 kept of a 40-token budget, in a trial) it only says "[...]"."""
    text = "HEAD:" + "m" * 300 + ":TAIL"
    cfg = job_config(
        buffer,
        tmp_path,
        f"env.kwargs={{done_at: 2, observation: '{text}'}}",
        f"env.max_observation_tokens={budget}",
        "rollout.max_new_tokens=400",
    )
    groups = [buffer.add_group(PROMPT, 1, 400, {"label": "ababab"})]
    _, (s,) = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    observation = s.response_ids[s.loss_mask == 0].tolist()
    assert len(observation) == budget
    kept = load_tokenizer(tiny_model_dir).decode(observation)
    assert kept.startswith("HEAD:mmm") and kept.endswith("mmm:TAIL")
    marker = f"[...middle of {len(text)} tokens cut...]" if budget == 200 else "\n[...]\n"
    assert marker in kept


def test_a_huge_observation_is_cut_as_text_before_it_is_tokenised(buffer, redis_url, tiny_model_dir, tmp_path):
    """A 1 MB tool output was tokenised whole under the tokenizer lock: every episode's decoding
    waited seconds a turn (step time 1.0 s -> 32.5 s in a trial)."""
    from slime.rollout.observations import CHARS_PER_KEPT_TOKEN, encode_observation

    cfg = job_config(buffer, tmp_path, "env.max_observation_tokens=60")
    tokenizer = load_tokenizer(tiny_model_dir)
    rollout = MultiTurnRollout(cfg.env, tokenizer, SamplingParams(), buffer, "w-huge")
    sample = buffer.get_group(buffer.add_group(PROMPT, 1, 80, {}))[0]
    text = "HEAD:" + "m" * 1_000_000 + ":TAIL"
    ids = rollout._encode_observation(text, sample)
    kept = tokenizer.decode(ids)
    assert len(ids) == 60 and kept.startswith("HEAD:mmm") and kept.endswith("mmm:TAIL") and "\n[...]\n" in kept
    ids = encode_observation(text, 400, rollout._ids, threading.Lock())  # a budget the long marker fits
    assert f"[...middle of {len(text) - 2 * CHARS_PER_KEPT_TOKEN * 400} characters cut...]" in tokenizer.decode(ids)


def test_an_observation_that_ends_in_a_stop_token_does_not_end_the_next_turn(
    buffer, redis_url, tiny_model_dir, tmp_path
):
    """'[obs k]' ends in ']', here a stop token: the engine took the transcript's last token for the
    turn's own stop, so every later turn ended at once with no tokens, and the env stepped on ''."""
    cfg = job_config(buffer, tmp_path, "rollout.ignore_eos=false", "rollout.stop=[']']")
    groups = [buffer.add_group(PROMPT, 2, 80, {"label": "ababab"})]
    _, samples = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    for s in samples:
        model_turns = int(s.loss_mask[0] == 1) + int(np.sum(np.diff(s.loss_mask) == 1))
        assert s.metadata["env_turns"] == 3 and model_turns == 3, s.loss_mask.tolist()


def test_an_async_env_runs_its_episodes_as_a_plain_one(buffer, redis_url, tiny_model_dir, tmp_path, reference):
    """async def step failed every episode: 'returned from step a coroutine, expected the tuple'."""
    cfg = job_config(buffer, tmp_path, "env.plugin=tests.test_multiturn:AsyncScriptedEnv")
    groups = [buffer.add_group(PROMPT, 2, 80, {"label": "ababab"})]
    _, samples = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    for s in samples:
        assert s.status == Status.COMPLETED and s.metadata["env_turns"] == 3 and s.reward == pytest.approx(0.75)
        assert_matches_reference(s, reference)


def test_reward_fn_mode_scores_the_transcript(buffer, redis_url, tiny_model_dir, tmp_path):
    cfg = job_config(buffer, tmp_path, "env.reward=reward_fn", "reward.fn=envs.repeat:reward")
    groups = [buffer.add_group(PROMPT, 1, 80, {"label": "ababab", "prompt_text": "ab*3="})]
    _, (s,) = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    assert s.status == Status.COMPLETED and s.reward is not None and s.reward != pytest.approx(0.75)
    assert s.metadata["env_return"] == pytest.approx(0.75) and s.metadata["env_turns"] == 3


def test_tool_env_through_the_worker(buffer, redis_url, tiny_model_dir, tmp_path):
    """The real ToolEnv as a plugin: every observation the worker stored is the tokenisation of a
    tool reply (<result> or <error>, cut to max_observation_tokens), with mask 0."""
    cfg = job_config(
        buffer,
        tmp_path,
        "env.plugin=envs.agent:ToolEnv",
        "env.kwargs={tools: [calculator]}",
        "env.max_turns=3",
        "env.max_turn_tokens=16",
        "env.max_observation_tokens=24",
        "rollout.temperature=1.0",
        "rollout.ignore_eos=false",
        "rollout.max_new_tokens=200",
    )
    groups = [buffer.add_group(PROMPT, 2, 200, {"label": "6"})]
    _, samples = run_worker(cfg, tiny_model_dir, redis_url, buffer, groups)
    tokenizer = load_tokenizer(tiny_model_dir)
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None
        mask = s.loss_mask.tolist()
        runs, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                runs.append((mask[start], start, i))
                start = i
        observations = [tokenizer.decode(s.response_ids[a:b].tolist()) for m, a, b in runs if m == 0]
        assert len(observations) == s.metadata["env_turns"] - (
            s.status == Status.COMPLETED or s.metadata["env_end"] == "max_turns"
        )
        for text in observations:
            assert text.startswith(("<error>", "<result")), text
            assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 24
        assert np.all(s.logprobs[s.loss_mask == 0] == 0) and np.all(s.logprobs[s.loss_mask == 1] < 0)


def test_bad_env_plugin_fails_at_config_and_at_load(buffer, tmp_path):
    with pytest.raises(ValueError, match="env.plugin"):
        job_config(buffer, tmp_path, "env.plugin=no_colon_here")
    from rewards.plugin import PluginError
    from slime.rollout.multiturn import MultiTurnRollout

    cfg = job_config(buffer, tmp_path, "env.plugin=tests.test_multiturn:NoSuchEnv")
    with pytest.raises(PluginError, match="NoSuchEnv"):
        MultiTurnRollout(cfg.env, None, SamplingParams(), buffer, "w")
    cfg = job_config(buffer, tmp_path, "env.kwargs={done_at: 2, sleep: 1}")  # sleep_s meant
    with pytest.raises(ConfigError, match=r"env.kwargs \['done_at', 'sleep'\] do not fit .*ScriptedEnv: .*'sleep'"):
        MultiTurnRollout(cfg.env, None, SamplingParams(), buffer, "w")


class _OneStep:
    def __init__(self, result):
        self.result = result

    def step(self, action):
        return self.result


@pytest.mark.parametrize(
    "result, error",
    [
        (("obs", float("nan"), False, {}), "a reward of nan, not a finite number"),
        (("obs", float("inf"), True, {}), "a reward of inf, not a finite number"),
        (("obs", "1.0", False, {}), "a reward of type str, expected a number"),
        (("obs", np.bool_(True), False, {}), "a reward of type bool"),
        (("obs", 1.0, False, ["not", "a", "dict"]), "an info of type list, expected a dict"),
        ((None, 1.0, False, {}), "an observation of type NoneType, expected str"),
        (("obs", 1.0), "from step a tuple of 2, expected the tuple"),
        ("obs", "from step a str, expected the tuple"),
    ],
)
def test_an_env_step_that_breaks_the_contract_fails_its_episode_naming_why(result, error):
    """What an env's step returns is checked before it reaches the buffer: a NaN or inf reward
    (one would make every weight NaN at the next update), a reward that is no number, an info that
    is no dict."""
    ep = _Episode(Sample(group_id="g", index=0, prompt_ids=[1], max_new_tokens=4), 0.0, env=_OneStep(result))
    with pytest.raises(EnvContractError, match=error):
        MultiTurnRollout._call_step(None, ep, "act")
    assert ep.turns_done == 0 and ep.env_return == 0.0
    # counted under what the env did, not as an exception it raised
    assert failure_key(f"env my_env.py:EchoEnv returned {error}: details") == "env my_env.py:EchoEnv returned"


def test_an_env_step_reward_may_be_a_numpy_number():
    ep = _Episode(Sample(group_id="g", index=0, prompt_ids=[1], max_new_tokens=4), 0.0)
    ep.env = _OneStep(("obs", np.float32(0.5), np.bool_(True), {"score": np.float64(2.0)}))
    assert MultiTurnRollout._call_step(None, ep, "act") == ("obs", 0.5, True, {"score": 2.0})
    assert ep.turns_done == 1 and ep.env_return == 0.5


def test_a_reward_fn_beside_env_reward_env_is_said_to_be_unused():
    from slime.config import load_config
    from slime.train import unused_reward_notice

    env = ["env.plugin=tests.test_multiturn:ScriptedEnv"]
    notice = unused_reward_notice(load_config(None, [*env, "reward.fn=rewards.rule:exact_match"]))
    assert notice is not None and "reward.fn=rewards.rule:exact_match is not called: with env.reward=env" in notice
    assert unused_reward_notice(load_config(None, env)) is None  # the default fn: nothing was asked for
    assert unused_reward_notice(load_config(None, [*env, "env.reward=reward_fn", "reward.fn=rewards.rule:f1"])) is None
    assert unused_reward_notice(load_config(None, ["reward.fn=rewards.rule:f1"])) is None  # no env


def test_an_env_call_that_completes_wakes_the_generation_loop(buffer, redis_url, tiny_model_dir, tmp_path):
    """The idle generation loop waits on an event that a completed env call sets (as a completed
    reward does): it picks the env's turn up at once, not at its 10 ms timeout."""
    cfg = job_config(buffer, tmp_path)
    woken = threading.Event()
    rollout = MultiTurnRollout(
        cfg.env, load_tokenizer(tiny_model_dir), SamplingParams(), buffer, "w-wake", on_env_done=woken.set
    )
    try:
        buffer.add_group(PROMPT, 1, 80, {})
        (sample,) = buffer.lease("w-wake", 1)
        rollout.begin(sample)  # the env's reset, on an env thread
        assert woken.wait(30), "the completed env reset did not wake the loop"
        assert [s.id for s, _ in rollout.poll(0)] == [sample.id]
    finally:
        rollout.close()
