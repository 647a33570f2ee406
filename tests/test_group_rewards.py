"""reward.scope=group: one call per complete group (slime's --group-rm, TRL's batch-level rewards).
The styles and their errors (rewards/group.py), the buffer's write of the scores, refusals at load,
held-out eval, and whole jobs under both launchers: the stored rewards are the group function's."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from rewards.adapters import RewardSignatureError
from rewards.group import (
    PER_RESPONSE_KEYS,
    GroupCall,
    GroupRewardSpecError,
    GroupScorer,
    load_group_reward,
    split_metadata,
)
from slime.buffer import TrajectoryStore
from slime.config import ConfigError, load_config
from slime.sample import Status
from tests.helpers import TINY_JOB, run_until_still_running


def _items(responses: list[str], label="ab", metadata=None) -> list[tuple]:
    return [("ab*2=", r, label, dict(metadata or {"prompt_text": "ab*2="})) for r in responses]


def relative_length(prompt, responses, label):
    mean = sum(map(len, responses)) / len(responses)
    return [len(r) - mean for r in responses]


async def slime_batched_rm(args, samples):
    await asyncio.sleep(0)
    return [float(s.response == args.label) for s in samples]


def trl_rank(completions, solution, **kwargs):
    ranked = sorted(completions, key=len)
    return [ranked.index(c) / (len(completions) - 1) for c in completions]


def openrlhf_func(queries, prompts, labels):
    return {"rewards": [float(q.endswith(lab)) for q, lab in zip(queries, labels)], "extra_logs": {"n": len(queries)}}


def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [{"score": float(s == g), "acc": s == g} for s, g in zip(solution_strs, ground_truths)]


def test_each_style_scores_the_whole_group_at_once():
    scorer = GroupScorer(GroupCall(relative_length, "relative_length"), timeout_s=5, max_concurrency=2)
    (native,) = scorer.score([_items(["a", "abc", "ab"])])
    assert [r.reward for r in native] == [-1.0, 1.0, 0.0]

    slime = GroupScorer(GroupCall(slime_batched_rm, "rm"), 5, 1).score([_items(["ab", "ba"])])[0]
    assert [r.reward for r in slime] == [1.0, 0.0]

    trl = GroupScorer(GroupCall(trl_rank, "trl_rank"), 5, 1).score(
        [_items(["xyz", "x", "xy"], metadata={"solution": "x"})]
    )[0]
    assert [r.reward for r in trl] == [1.0, 0.0, 0.5]  # the group's columns reach TRL as one list

    openrlhf = GroupScorer(GroupCall(openrlhf_func, "reward_func"), 5, 1).score([_items(["ab", "b"], label="b")])[0]
    assert [r.reward for r in openrlhf] == [1.0, 1.0] and openrlhf[0].info == {"n": 2}

    # verl's batch reward manager's call; its rows keep the answer in reward_model.ground_truth
    row = {"reward_model": {"ground_truth": "ab"}, "data_source": "repeat"}
    verl = GroupScorer(GroupCall(verl_batch, "compute_score"), 5, 1).score([_items(["ab", "a"], None, row)])[0]
    assert [r.reward for r in verl] == [1.0, 0.0]


class LoopBound:
    """An async group reward holding a loop-bound object across calls (as an httpx.AsyncClient does)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, prompt, responses, metadata):
        self.loop = self.loop or asyncio.get_running_loop()  # where a client made on first use lives
        if self.loop is not asyncio.get_running_loop():
            raise RuntimeError("called on another event loop than the first call's")
        assert metadata["prompt_text"] == "p"  # the group's shared row
        assert metadata["response_ids"] == [[1], [1]]  # and what is each response's own, one per response
        return [1.0] * len(responses)


def test_async_group_rewards_share_one_loop_and_see_the_groups_shared_metadata():
    scorer = GroupScorer(GroupCall(LoopBound(), "loop_bound"), timeout_s=5, max_concurrency=2)
    groups = [_items(["a", "b"], metadata={"prompt_text": "p", "response_ids": [1]}) for _ in range(4)]
    for _ in range(2):
        assert all(r.reward == 1.0 for g in scorer.score(groups) for r in g), scorer.score(groups)
    scorer.close()


def test_an_async_group_reward_past_its_timeout_is_cancelled_and_close_ends_the_loop():
    cancelled = threading.Event()

    async def slow(prompt, responses):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [1.0] * len(responses)

    scorer = GroupScorer(GroupCall(slow, "slow"), timeout_s=0.3, max_concurrency=2)
    (late,) = scorer.score([_items(["a"])])
    assert "took longer than reward.timeout_s=0.3" in late[0].failure
    assert cancelled.wait(5)  # the coroutine was stopped, not left running on the loop
    deadline = time.monotonic() + 5
    while scorer.hung and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scorer.hung == 0
    loop_thread = scorer._loop_thread
    scorer.close()
    assert not loop_thread.is_alive() and scorer._loop.is_closed()


def test_a_bad_group_fails_its_own_samples_with_the_reason_and_the_others_are_scored():
    def picky(prompt, responses):
        if "boom" in responses:
            raise RuntimeError("no booms")
        if "short" in responses:
            return [1.0]
        if "slow" in responses:
            time.sleep(3)
        return [None if r == "skip" else 1.0 for r in responses]

    scorer = GroupScorer(GroupCall(picky, "picky"), timeout_s=1.0, max_concurrency=4)
    boom, short, slow, skip, fine = scorer.score(
        [_items(["a", "boom"]), _items(["short", "b"]), _items(["slow", "c"]), _items(["skip", "d"]), _items(["e"])]
    )
    assert all(r.reward is None and r.failure == "group reward picky raised RuntimeError: no booms" for r in boom)
    assert all("picky returned 1 rewards for a group of 2 responses" in r.failure for r in short)
    assert all("took longer than reward.timeout_s=1" in r.failure for r in slow)
    assert skip[0].reward is None and "gave None for this response" in skip[0].failure and skip[1].reward == 1.0
    assert [r.reward for r in fine] == [1.0]
    scorer.close()


def test_each_group_gets_its_own_timeout_from_when_its_call_starts():
    def steady(prompt, responses):
        time.sleep(0.3 if responses[0] != "slow" else 1.5)
        return [1.0] * len(responses)

    scorer = GroupScorer(GroupCall(steady, "steady"), timeout_s=0.6, max_concurrency=1)
    # one slot: the third group starts ~0.6 s after the first, each call within its own 0.6 s
    assert all(r.reward == 1.0 for g in scorer.score([_items(["a"]), _items(["b"]), _items(["c"])]) for r in g)
    (slow,) = scorer.score([_items(["slow"])])
    assert "took longer than reward.timeout_s=0.6" in slow[0].failure and scorer.hung == 1
    deadline = time.monotonic() + 5
    while scorer.hung and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scorer.hung == 0  # the late call ended: no longer counted
    scorer.close()


def test_a_per_sample_function_mix_and_route_are_refused_for_groups(tmp_path: Path):
    def per_sample(prompt, response, label):
        return 1.0

    with pytest.raises(RewardSignatureError, match="looks like a per-sample reward: leave reward.scope at 'sample'"):
        GroupCall(per_sample, "per_sample")
    with pytest.raises(GroupRewardSpecError, match=r"is one function .*\(mix and route combine per-sample rewards\)"):
        load_group_reward({"mix": [{"fn": "envs.repeat:reward", "weight": 1.0}]})
    path = tmp_path / "group_fns.py"
    path.write_text(
        "def factory(scale):\n    def f(prompt, responses):\n        return [scale] * len(responses)\n    return f\n"
    )
    call = load_group_reward({"fn": f"{path}:factory", "kwargs": {"scale": 2.0}})
    assert call(_items(["a", "b"])) == [2.0, 2.0]


@pytest.mark.parametrize(
    "setting, named",
    [
        (["reward.mode=http", "reward.url=http://127.0.0.1:1"], "reward.mode must be in_process"),
        (["april.filter_zero_variance=true"], "april.filter_zero_variance and april.group_filter read the rewards"),
        (["april.group_filter=f.py:keep"], "april.filter_zero_variance and april.group_filter read the rewards"),
        (["algorithm.name=ppo", "april.streaming_chunk_tokens=8"], "april.streaming_chunk_tokens trains"),
        (["env.plugin=envs.calculator:CalculatorEnv"], "set env.reward=reward_fn"),
    ],
)
def test_what_group_rewards_cannot_work_with_is_refused_at_load(setting, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["reward.scope=group", *setting])


def test_the_buffer_stores_group_scores_and_counts_a_failure_once(buffer: TrajectoryStore):
    gid = buffer.add_group([1, 2, 3], 2, 4, {"label": "x"})
    for s in buffer.lease("w0", 2):
        buffer.append_chunk(s.id, "w0", [5, 6], [-0.1, -0.2], 0)
        buffer.finish(s.id, "w0", Status.COMPLETED)
    a, b = buffer.get_group(gid)
    assert a.reward is None  # the workers stored no reward
    for _ in range(2):  # written again: the same result, the failure counted once
        writes = [(a.id, 0.75, None, {"reward_info": {"rank": 1}}, None), (b.id, None, "no", None, Status.FAILED)]
        assert buffer.set_rewards(writes) == 2
    a, b = buffer.get_group(gid)
    assert (a.reward, a.status, a.metadata["reward_info"]) == (0.75, Status.COMPLETED, {"rank": 1})
    assert (b.status, b.failure, b.reward) == (Status.FAILED, "no", None)
    assert buffer.counts()["failed"] == 1 and buffer.counts()["completed"] == 1
    # scored again with a reward: the failure goes, the status and the counts come back
    assert buffer.set_rewards([(b.id, 0.5, None, None, Status.COMPLETED)]) == 1
    b = buffer.get_group(gid)[1]
    assert (b.status, b.failure, b.reward) == (Status.COMPLETED, None, 0.5)
    assert buffer.counts()["failed"] == 0 and buffer.counts()["completed"] == 2


FLAKY_JUDGE_PY = """
CALLS = [0]


def judge(prompt, responses):
    CALLS[0] += 1
    if CALLS[0] == 1:
        raise TimeoutError("the judge timed out once")
    return [1.0 for r in responses]
"""


def test_a_group_scored_again_after_a_restart_scores_what_its_first_scoring_failed(
    buffer: TrajectoryStore, tiny_model_dir, tmp_path: Path
):
    """A claim requeued by a restart is scored again: samples the first scoring failed are scored
    too, and their status, reward and counts come back."""
    from slime.learner.group_rewards import GroupRewards

    (tmp_path / "flaky_judge.py").write_text(FLAKY_JUDGE_PY)
    cfg = load_config(None, ["reward.scope=group", f"reward.fn={tmp_path / 'flaky_judge.py'}:judge"])
    rewards = GroupRewards(cfg, str(tiny_model_dir))
    gid = buffer.add_group([3, 4, 5], 2, 8, {"label": "x", "prompt_text": "p"})
    for s, status in zip(buffer.lease("w0", 2), (Status.COMPLETED, Status.TRUNCATED)):
        buffer.append_chunk(s.id, "w0", [5, 6, 7], [-0.1] * 3, 0)
        buffer.finish(s.id, "w0", status)
    rewards.score([buffer.get_group(gid)], buffer)
    first = buffer.get_group(gid)
    assert all(s.status == Status.FAILED and "the judge timed out once" in s.failure for s in first)
    again = buffer.get_group(gid)  # what a claim after the restart reads
    rewards.score([again], buffer)
    stored = buffer.get_group(gid)
    assert [s.status for s in stored] == [Status.COMPLETED, Status.TRUNCATED]  # as generated
    assert all(s.failure is None and s.reward == 1.0 for s in stored + again)
    assert all("generated_status" not in s.metadata for s in stored)
    assert buffer.counts()["failed"] == 0
    rewards.close()


GROUP_REWARD_PY = """
import threading

LOCK = threading.Lock()
CALLS = [0]


def relative_length(prompt, responses, label, metadata):
    with LOCK:
        CALLS[0] += 1
        first = CALLS[0] == 1
    if first:
        raise RuntimeError("the first group fails on purpose")
    mean = sum(map(len, responses)) / len(responses)
    return [len(r) - mean for r in responses]
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_job_with_group_rewards_trains_on_the_group_functions_scores(
    ray_session, tiny_model_dir, redis_url, tmp_path, launcher
):
    """The learner scores each group it claims; the stored rewards are the function's: within each
    group they sum to 0 and order the responses by length. The group whose call raised is failed,
    its reason stored, and the job goes on."""
    from slime.model import load_tokenizer
    from slime.train import train

    module = f"group_reward_{launcher}"  # one name per launcher: this process imports both
    (tmp_path / f"{module}.py").write_text(GROUP_REWARD_PY)
    job = f"group-rewards-{launcher}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"cluster.launcher={launcher}",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *TINY_JOB,
                "rollout.batch_size=3",
                "rollout.n_samples_per_prompt=3",
                "steps=2",
                "reward.scope=group",
                f"reward.fn={tmp_path / module}.py:relative_length",
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1]
    assert sum(h["failed_samples"] for h in history) == 3  # the one group whose call raised
    assert all(h["group_reward_seconds"] >= 0 and h["trained_tokens"] > 0 for h in history)
    buffer = TrajectoryStore.open(redis_url, job)
    tokenizer = load_tokenizer(tiny_model_dir)
    groups = [buffer.get_group(g.decode()) for g in buffer.redis.zrange(buffer._key("trained"), 0, -1)]
    assert len(groups) == 6
    failed = [g for g in groups if any(s.status == Status.FAILED for s in g)]
    assert len(failed) == 1 and all("the first group fails on purpose" in s.failure for s in failed[0])
    for group in groups:
        if group in failed:
            continue
        # the response as scored: the stop token cut, the rest decoded without special tokens
        lengths = [
            len(tokenizer.decode(_without_eos(s.response_ids.tolist(), tokenizer), skip_special_tokens=True))
            for s in group
        ]
        mean = sum(lengths) / len(lengths)
        assert [s.reward for s in group] == pytest.approx([n - mean for n in lengths])
        assert all(s.metadata["reward_latency_s"] >= 0 for s in group)
    buffer.delete_job()


def _without_eos(ids: list[int], tokenizer) -> list[int]:
    return ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids


@pytest.mark.slow
def test_held_out_eval_scores_each_prompts_answers_as_one_group(tiny_model_dir, tmp_path):
    from slime.evaluation import evaluate_model_dir, held_out_records
    from slime.model import load_tokenizer

    path = tmp_path / "group_size.py"
    path.write_text("def size(prompt, responses):\n    return [float(len(responses))] * len(responses)\n")
    job = load_config(
        None,
        [f"model.path={tiny_model_dir}", "reward.scope=group", f"reward.fn={path}:size", "eval.samples=2"]
        + ["eval.num_prompts=3", "rollout.max_new_tokens=8", f"output_dir={tmp_path}"],
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    result = evaluate_model_dir(job, tiny_model_dir, held_out_records(job, tokenizer, tmp_path), tokenizer)
    # each prompt's greedy answer and its 2 samples: one group of 3
    assert result["greedy_reward_mean"] == 3.0 and result["sampled_reward_mean"] == 3.0


def test_what_each_response_has_of_its_own_is_given_per_response_never_as_the_groups():
    """A native group reward got the FIRST response's finish_reason (and other per-response keys)
    as the group's: a rule penalising truncated responses penalised stopped ones."""
    seen = {}
    row = {"prompt_text": "q", "label": "ab", "task": "math"}
    ends = [{"finish_reason": "stop", "max_new_tokens": 8}, {"finish_reason": "length", "max_new_tokens": 8}]
    items = [("q", r, "ab", {**row, **end, "response_ids": ids}) for r, end, ids in zip(["ab", "a"], ends, [[1], [2]])]

    def native(prompt, responses, metadata):
        seen["native"] = metadata
        return [-1.0 if end == "length" else 1.0 for end in metadata["finish_reason"]]

    def slime_rm(args, samples):
        seen["slime"] = args, samples
        return [1.0, 1.0]

    def trl_reward(completions, finish_reason, **kwargs):
        return [-1.0 if end == "length" else 1.0 for end in finish_reason]

    def verl_rm(data_sources, solution_strs, ground_truths, extra_infos):
        return [-1.0 if info["finish_reason"] == "length" else 1.0 for info in extra_infos]

    for fn in (native, trl_reward, verl_rm):
        assert [r.reward for r in GroupScorer(GroupCall(fn, fn.__name__), 5, 1).score([items])[0]] == [1.0, -1.0]
    metadata = seen["native"]
    assert {k: metadata[k] for k in row} == row  # the row the group shares, as it is
    assert metadata["finish_reason"] == ["stop", "length"] and metadata["max_new_tokens"] == [8, 8]
    assert metadata["response_ids"] == [[1], [2]]

    GroupScorer(GroupCall(slime_rm, "slime_rm"), 5, 1).score([items])
    args, samples = seen["slime"]
    assert not hasattr(args, "finish_reason") and "finish_reason" not in args.metadata and args.task == "math"
    assert args.rollout_max_response_len == 8 and args.label == "ab"
    assert [s.status.value for s in samples] == ["completed", "truncated"]  # each sample its own
    assert [s.metadata["finish_reason"] for s in samples] == ["stop", "length"]

    # a key the job does not list that differs between responses is not shown as shared either
    shared, per_response = split_metadata([{"a": 1, "b": [1]}, {"a": 1, "b": [2], "c": 0}])
    assert shared == {"a": 1} and per_response == {"b": [[1], [2]], "c": [None, 0]}


def test_every_key_the_job_writes_is_the_groups_or_each_responses():
    from slime.data import JOB_METADATA_KEYS

    per_prompt = {"prompt_text", "prompt_messages", "record_index", "model_prompt"}
    assert set(JOB_METADATA_KEYS) == per_prompt | set(PER_RESPONSE_KEYS), "classify the new key in rewards/group.py"


KEEP_ALL_PY = """
SEEN = []


def keep_all(args, samples):
    SEEN.append(args)
    return True
"""


def test_a_group_filters_args_hold_what_the_group_shares(tmp_path: Path):
    """april.group_filter's slime-style `args` came from the first sample's metadata alone."""
    from rewards.group_filter import GroupFilter
    from rewards.plugin import load_function
    from slime.sample import Sample

    class Letters:  # a tokenizer: token i is the letter chr(96 + i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + int(i)) for i in ids)

    def sample(i: int, ids: list[int], budget: int, status: Status) -> Sample:
        n = len(ids)
        arrays = {"response_ids": ids, "logprobs": [0.0] * n, "versions": [0] * n, "loss_mask": [1] * n}
        return Sample("g", i, [1], budget, status=status, reward=1.0, metadata={"label": "ab"}, **arrays)

    (tmp_path / "keep.py").write_text(KEEP_ALL_PY)
    spec = f"{tmp_path / 'keep.py'}:keep_all"
    group = [sample(0, [1, 2], 6, Status.COMPLETED), sample(1, [1, 2, 3, 4], 4, Status.TRUNCATED)]
    assert GroupFilter(spec, Letters(), []).keep(group)
    (args,) = load_function(spec).__globals__["SEEN"]
    assert not hasattr(args, "finish_reason") and "response_ids" not in args.metadata
    assert args.label == "ab" and args.rollout_max_response_len == 6  # the group's largest budget


SLIME_DAPO_FILTER_PY = """
import torch

from slime.rollout.filter_hub.base_types import DynamicFilterOutput


def check_reward_nonzero_std(args, samples, **kwargs):  # as slime's filters are written
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = torch.tensor(rewards, dtype=torch.float).std() > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")
"""


@pytest.mark.parametrize("own_file", [True, False])
def test_a_filter_written_for_slime_runs_unchanged(tmp_path: Path, own_file: bool):
    """slime's DAPO filter imports slime.rollout.filter_hub, reads get_reward_value(args) and answers
    with a 0-d torch bool; slime's own filter loads by its module path too."""
    from rewards.group_filter import GroupFilter
    from slime.sample import Sample

    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + int(i)) for i in ids)

    def group(*rewards: float) -> list[Sample]:
        arrays = {"response_ids": [1], "logprobs": [0.0], "versions": [0], "loss_mask": [1]}
        return [Sample("g", i, [1], 4, status=Status.COMPLETED, reward=r, **arrays) for i, r in enumerate(rewards)]

    (tmp_path / "dapo_filter.py").write_text(SLIME_DAPO_FILTER_PY)
    spec = (
        f"{tmp_path / 'dapo_filter.py'}:check_reward_nonzero_std"
        if own_file
        else "slime.rollout.filter_hub.dynamic_sampling_filters:check_reward_nonzero_std"
    )
    check = GroupFilter(spec, Letters(), [])
    assert check.keep(group(1.0, 0.0, 1.0)) is True
    assert check.keep(group(1.0, 1.0, 1.0)) is False


def verl_with_extras(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"score": float(s == g), "acc": s == g, "pred": s} for s, g in zip(solution_strs, ground_truths)]


def test_a_verl_group_rewards_other_dict_keys_are_its_info_as_per_sample():
    """They were dropped: no reward_info, no reward_info/acc metric, unlike a per-sample verl reward."""
    right, wrong = GroupScorer(GroupCall(verl_with_extras, "compute_score"), 5, 1).score([_items(["ab", "a"])])[0]
    assert (right.reward, right.info) == (1.0, {"acc": True, "pred": "ab"})
    assert (wrong.reward, wrong.info) == (0.0, {"acc": False, "pred": "a"})


def test_a_group_reward_that_exits_fails_its_group_and_no_call_is_counted_hung():
    """sys.exit ended the call's thread: the group was reported as past reward.timeout_s at once and
    counted in group_reward_hung_calls for ever."""

    def soft(prompt, responses):
        sys.exit(3)

    async def soft_async(prompt, responses):
        sys.exit("done")

    for fn, code in ((soft, "3"), (soft_async, "done")):
        scorer = GroupScorer(GroupCall(fn, fn.__name__), timeout_s=30, max_concurrency=1)
        started = time.monotonic()
        for _ in range(2):  # the scorer (and an async function's loop) serves on
            results = scorer.score([_items(["a", "b"])])[0]
            assert all(r.reward is None and "exited" in r.failure and code in r.failure for r in results), results
            assert all("took longer" not in r.failure for r in results)
        assert time.monotonic() - started < 10 and scorer.hung == 0
        scorer.close()


EXITING_GROUP_REWARDS = """
import asyncio, os
from rewards.group import GroupCall, GroupScorer

def hard(prompt, responses):
    os._exit(7)

async def hard_async(prompt, responses):
    await asyncio.sleep(0)
    os._exit(7)

for fn in (hard, hard_async):
    scorer = GroupScorer(GroupCall(fn, fn.__name__), timeout_s=30, max_concurrency=1)
    for _ in range(2):
        (results,) = scorer.score([[("q", "a", None, {}), ("q", "b", None, {})]])
        print(fn.__name__, "|", results[0].failure, "|", results[1].failure, "|", scorer.hung, flush=True)
    scorer.close()
print("still running", flush=True)
"""


def test_an_os_exit_in_a_group_reward_fails_its_group_and_the_process_lives(tmp_path: Path):
    """Group rewards had no exit guard: os._exit in one ended the job (rc 7, no output)."""
    done = run_until_still_running(tmp_path / "exiting_group.py", EXITING_GROUP_REWARDS)
    lines = [line.split(" | ") for line in done.stdout.splitlines() if " | " in line]
    assert [line[0] for line in lines] == ["hard", "hard", "hard_async", "hard_async"]
    for name, first, second, hung in lines:
        assert first == second and f"group reward {name}" in first and "os._exit(7)" in first, first
        assert "exited" in first and hung == "0"
