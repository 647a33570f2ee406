"""rewards.adapters: slime, verl and TRL reward functions called unchanged through the native signature."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import pytest

from rewards.adapters import RewardSignatureError, adapt, detect_style, load_reward
from rewards.plugin import load_function
from rewards.runner import RewardRunner

# --- real functions in each framework's style ----------------------------------------------------


async def slime_rm(args, sample):
    """slime: `async def rm(args, sample)`; reads the sample's fields and the args namespace."""
    await asyncio.sleep(0)
    bonus = 0.5 if sample.metadata.get("difficulty") == "hard" else 0.0
    base = 1.0 if sample.response.strip() == str(sample.label) else 0.0
    assert args.rm_type in (None, "exact")
    assert args.label == sample.label and args.metadata is sample.metadata
    return base + bonus


def slime_rm_sync(args, sample, **kwargs):
    return float(sample.prompt.endswith("=") and args.difficulty == "easy")


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl: the full signature, returning a dict with 'score' and extra metrics."""
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"reward function is not implemented for data_source={data_source}")
    match = re.search(r"#### (-?[0-9.,]+)", solution_str)
    answer = match.group(1).replace(",", "") if match else None
    acc = answer == ground_truth
    return {"score": 1.0 if acc else 0.1 * (answer is not None), "acc": acc, "split": (extra_info or {}).get("split")}


def verl_gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's per-dataset helpers take no data_source/extra_info."""
    match = re.search(r"#### (-?[0-9.,]+)", solution_str)
    if match is None:
        return 0.0
    return score if match.group(1) == ground_truth else format_score


def trl_accuracy(completions, solution, **kwargs):
    """TRL: dataset columns arrive as lists, one entry per completion."""
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def trl_format(completions, **kwargs):
    return [
        1.0 if re.fullmatch(r"<think>.*?</think>\s*<answer>.*?</answer>", c, re.DOTALL) else 0.0 for c in completions
    ]


def trl_uses_prompts(prompts, completions, ground_truth, difficulty, **kwargs):
    return [len(p) + (c == g) + (d == "hard") for p, c, g, d in zip(prompts, completions, ground_truth, difficulty)]


def trl_strict(completions, solution):  # no **kwargs: only the columns it names are passed
    return [float(c == s) for c, s in zip(completions, solution)]


async def trl_async(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def trl_broken(completions, **kwargs):
    return [1.0, 0.0]  # two scores for one completion


def trl_scalar(completions, **kwargs):
    return 1.0


def native(prompt, response, label, metadata):
    return float(response == label)


# --- detection -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, style",
    [
        (slime_rm, "slime"),
        (slime_rm_sync, "slime"),
        (verl_compute_score, "verl"),
        (verl_gsm8k_style, "verl"),
        (trl_accuracy, "trl"),
        (trl_format, "trl"),
        (trl_uses_prompts, "trl"),
        (native, "native"),
    ],
)
def test_detect_style(fn, style):
    assert detect_style(fn) == style


def test_native_is_returned_unchanged():
    assert adapt(native) is native
    assert load_reward("envs.repeat:reward") is load_function("envs.repeat:reward")


def test_ambiguous_and_unknown_signatures_are_refused_with_the_accepted_forms():
    def both(prompt, response, completions):
        return 0.0

    def neither(x, y):
        return 0.0

    with pytest.raises(RewardSignatureError) as e:
        adapt(both)
    msg = str(e.value)
    assert "both" in msg and "matches several styles (native, trl)" in msg
    assert "slime `async def rm(args, sample)`" in msg and "verl `compute_score(" in msg and "TRL `f(completions" in msg
    with pytest.raises(
        RewardSignatureError,
        match=r"neither\(x, y\) matches no supported style; choose its style in the config, reward.fn=\{fn: \S*neither, style: S\}",
    ):
        adapt(neither)


def test_style_override_and_bad_style():
    def wrapper(*args, **kwargs):
        return [float(kwargs["completions"][0] == "ok")]

    fn = adapt(wrapper, style="trl")
    assert fn("p", "ok", None, {}) == 1.0
    with pytest.raises(
        ValueError, match=r"unknown style 'deepspeed'; choose one of native, slime, verl, trl, openrlhf"
    ):
        adapt(wrapper, style="deepspeed")


# --- slime ---------------------------------------------------------------------------------------


def test_slime_async_rm():
    fn = adapt(slime_rm)
    assert inspect.iscoroutinefunction(fn)
    assert asyncio.run(fn("2+2=", " 4 ", "4", {"difficulty": "hard"})) == 1.5
    assert asyncio.run(fn("2+2=", "5", "4", {"difficulty": "easy", "rm_type": "exact"})) == 0.0


def test_slime_sync_rm_stays_sync_and_sees_metadata_as_args():
    fn = adapt(slime_rm_sync)
    assert not inspect.iscoroutinefunction(fn)
    assert fn("ab*2=", "abab", "abab", {"difficulty": "easy"}) == 1.0
    assert fn("ab*2=", "abab", "abab", {"difficulty": "hard"}) == 0.0


def test_a_reward_file_written_for_slime_loads_unchanged(tmp_path):
    """slime's reward files import its Sample (`from slime.utils.types import Sample`) and compare
    the status with `Sample.Status`; the file loads as is and gets a Sample of that class."""
    path = tmp_path / "slime_reward.py"
    path.write_text(
        "from slime.utils.types import Sample\n\n\n"
        "async def reward_func(args, sample: Sample, **kwargs):\n"
        "    assert isinstance(sample, Sample) and sample.status == Sample.Status.COMPLETED\n"
        "    return float(sample.response.strip() == sample.label)\n"
    )
    fn = load_reward(f"{path}:reward_func")
    assert asyncio.run(fn("2+2=", " 4 ", "4", {})) == 1.0
    assert asyncio.run(fn("2+2=", "5", "4", {})) == 0.0


SLIME_OVERLONG_REWARD = """
async def overlong_penalty(args, sample, **kwargs):
    budget, cache = args.rollout_max_response_len, 4  # DAPO's soft overlong punishment
    return min(0.0, (budget - cache - sample.response_length) / cache)
"""


def test_a_slime_reward_reads_the_response_length_and_is_told_where_the_token_arrays_are(tmp_path):
    path = tmp_path / "overlong.py"
    path.write_text(SLIME_OVERLONG_REWARD)
    fn = load_reward(f"{path}:overlong_penalty")
    assert asyncio.run(fn("p", "r", None, {"response_ids": [5] * 6, "max_new_tokens": 8})) == -0.5
    assert asyncio.run(fn("p", "r", None, {"response_ids": [5] * 2, "max_new_tokens": 8})) == 0.0

    from rewards.adapters import slime_sample

    with pytest.raises(AttributeError, match=r"Sample.tokens: .* metadata\['response_ids'\]"):
        _ = slime_sample("p", "r", None, {"response_ids": [5]}).tokens
    with pytest.raises(AttributeError, match="no attribute 'respone'"):
        _ = slime_sample("p", "r", None, {}).respone


SLIME_TRUNCATION_REWARD = """
from slime.utils.types import Sample


async def no_credit_when_cut(args, sample: Sample, **kwargs):
    assert args.rollout_max_response_len == sample.metadata["max_new_tokens"]  # slime's name for the budget
    if sample.status == Sample.Status.TRUNCATED:  # DAPO-style rewards penalise a cut response
        return 0.0
    assert sample.status == Sample.Status.COMPLETED
    return 1.0
"""


def test_a_slime_reward_sees_a_response_cut_by_max_new_tokens_as_truncated(tmp_path):
    path = tmp_path / "cut.py"
    path.write_text(SLIME_TRUNCATION_REWARD)
    fn = load_reward(f"{path}:no_credit_when_cut")
    assert asyncio.run(fn("p", "r", None, {"finish_reason": "length", "max_new_tokens": 6})) == 0.0
    assert asyncio.run(fn("p", "r", None, {"finish_reason": "stop", "max_new_tokens": 6})) == 1.0


@pytest.mark.slow
def test_in_a_job_the_rollout_tells_a_reward_how_each_response_ended(tiny_model_dir, redis_url, tmp_path):
    """The worker gives each reward call `finish_reason` (a slime reward: the sample's status): every
    sample the buffer stores as TRUNCATED got 0 from the reward above, every COMPLETED one 1."""
    from slime.buffer.store import TrajectoryStore
    from slime.config import load_config
    from slime.sample import Status
    from slime.train import train

    (tmp_path / "cut.py").write_text(SLIME_TRUNCATION_REWARD)
    job = "reward-sees-truncation"
    train(
        load_config(
            None,
            [
                f"job_name={job}",
                "cluster.launcher=local",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=4",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=6",  # about half the example's answers are longer
                "logging.progress=false",
                "steps=1",
                f"reward.fn={tmp_path / 'cut.py'}:no_credit_when_cut",
            ],
        )
    )
    buffer = TrajectoryStore.open(redis_url, job)
    samples = [s for s in buffer.iter_samples() if s.status in (Status.TRUNCATED, Status.COMPLETED)]
    assert {s.status for s in samples} == {Status.TRUNCATED, Status.COMPLETED}, [s.status for s in samples]
    assert not [s.failure for s in buffer.iter_samples() if s.status == Status.FAILED]  # its asserts held
    assert all(s.reward == (0.0 if s.status == Status.TRUNCATED else 1.0) for s in samples)
    buffer.delete_job()


# --- verl ----------------------------------------------------------------------------------------


def test_verl_full_signature_dict_score_and_data_source():
    fn = adapt(verl_compute_score)
    meta = {"data_source": "openai/gsm8k", "split": "train"}
    # the dict's other keys, which verl logs, are the sample's reward_info (its numbers become step metrics)
    assert fn("q", "so #### 1,234", "1234", meta) == {"score": 1.0, "info": {"acc": True, "split": "train"}}
    assert fn("q", "so #### 7", "1234", meta)["score"] == pytest.approx(0.1)
    assert fn("q", "no idea", "1234", {"task": "openai/gsm8k"})["score"] == 0.0  # data_source falls back to "task"
    with RewardRunner(fn, 5.0, 1) as runner:
        result = runner.score("q", "so #### 7", "1234", meta)
    assert result.reward == pytest.approx(0.1) and result.info == {"acc": False, "split": "train"}
    with pytest.raises(NotImplementedError, match="data_source=None"):
        fn("q", "#### 1", "1", {})


def test_verl_dataset_helper_without_data_source():
    fn = adapt(verl_gsm8k_style)
    assert fn("q", "#### 72", "72", {"data_source": "gsm8k"}) == 1.0
    assert fn("q", "#### 71", "72", {}) == 0.0


def test_verl_dict_without_score_is_an_error():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(
        ValueError, match=r"verl-style reward .*compute_score returned a dict without a 'score' key \(keys: \['acc'\]\)"
    ):
        adapt(compute_score)("p", "r", "l", {})


# --- TRL -----------------------------------------------------------------------------------------


def test_trl_columns_reach_the_function_as_one_element_lists():
    assert adapt(trl_accuracy)("p", " 42", None, {"solution": "42"}) == 1.0
    assert adapt(trl_accuracy)("p", "41", None, {"solution": "42"}) == 0.0
    assert adapt(trl_format)("p", "<think>hm</think> <answer>4</answer>", None, {}) == 1.0
    # prompts=[prompt], ground_truth=[label], metadata columns as lists: 3 + 1 + 1
    assert adapt(trl_uses_prompts)("abc", "x", "x", {"difficulty": "hard"}) == 5
    assert adapt(trl_strict)("p", "a", None, {"solution": "a", "other_column": 1}) == 1.0


def test_trl_async_stays_async():
    fn = adapt(trl_async)
    assert inspect.iscoroutinefunction(fn)
    assert asyncio.run(fn("p", "abcd", None, {})) == 4.0


def test_trl_errors_name_the_function():
    with pytest.raises(
        ValueError,
        match=r"TRL-style reward .*trl_broken returned 2 scores for 1 completion; expected a list of exactly 1",
    ):
        adapt(trl_broken)("p", "r", None, {})
    with pytest.raises(
        TypeError, match=r"trl_scalar returned float 1.0; expected a list with one score per completion"
    ):
        adapt(trl_scalar)("p", "r", None, {})
    with pytest.raises(
        TypeError,
        match=r"trl_strict requires \['solution'\], which this sample does not have \(dataset columns in metadata: \['ground_truth', 'label', 'task'\]\)",
    ):
        adapt(trl_strict)("p", "r", None, {"task": "math"})


# --- loading from a file and running -------------------------------------------------------------


def test_load_reward_from_file_and_run_through_the_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_trl.py").write_text(
        "def accuracy(completions, solution, **kwargs):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\n"
    )
    (tmp_path / "my_slime.py").write_text(
        "async def rm(args, sample):\n    return float(sample.response == sample.label)\n"
    )
    with RewardRunner(load_reward("my_trl.py:accuracy"), 5.0, 2, name="my_trl.py:accuracy") as runner:
        assert runner.score("p", "7", None, {"solution": "7"}).reward == 1.0
        bad = runner.score("p", "7", None, {})
        assert bad.reward is None and "requires ['solution']" in bad.failure
    with RewardRunner(load_reward("my_slime.py:rm"), 5.0, 2) as runner:
        assert runner.score("p", "yes", "yes", {}).reward == 1.0
        assert runner.score("p", "no", "yes", {}).reward == 0.0


def test_trls_own_completion_ids_rewards_plug_in_as_factories():
    """TRL's built-in length and repetition rewards take `completion_ids` alone: the response's
    tokens (metadata["response_ids"], as the rollout worker gives them), EOS included as in TRL."""
    from rewards.mix import load_reward_spec

    overlong = load_reward_spec(
        {"fn": "trl.rewards:get_soft_overlong_punishment", "kwargs": {"max_completion_len": 8, "soft_punish_cache": 4}}
    )
    # TRL's schedule: 0 up to max - cache tokens, then down linearly to -1 at max, -1 beyond
    assert overlong("p", "r", None, {"response_ids": [5] * 4}) == 0.0
    assert overlong("p", "r", None, {"response_ids": [5] * 6}) == pytest.approx((8 - 4 - 6) / 4)
    assert overlong("p", "r", None, {"response_ids": [5] * 9}) == -1.0
    with pytest.raises(TypeError, match=r"requires \['completion_ids'\], which this sample does not have"):
        overlong("p", "r", None, {})


def test_trl_log_metric_and_log_extra_land_in_the_rewards_info():
    def scored(completions, log_metric, log_extra, **kwargs):
        log_metric("length", len(completions[0]))
        log_extra("upper", [completions[0].upper()])
        return [1.0]

    assert adapt(scored)("p", "abc", None, {}) == {"score": 1.0, "info": {"length": 3, "upper": "ABC"}}
    with RewardRunner(adapt(scored), 5.0, 1) as runner:
        result = runner.score("p", "ab", None, {})
    assert (result.reward, result.info) == (1.0, {"length": 2, "upper": "AB"})


def test_trls_own_conversational_rewards_get_messages_for_chat_prompts():
    """TRL's think_format_reward reads completions[i][0]["content"]: chat-message prompts
    (prompt_messages in the metadata) give TRL's conversational format, per sample and per group."""
    from rewards.group import GroupCall
    from rewards.mix import load_reward_spec

    chat = {"prompt_messages": [{"role": "user", "content": "2+2?"}]}
    think = load_reward_spec("trl.rewards:think_format_reward")
    assert think("2+2?", "<think>add</think>4", None, chat) == 1.0
    assert think("2+2?", "4", None, chat) == 0.0
    group = GroupCall(load_function("trl.rewards:think_format_reward"), "think_format_reward")
    assert group([("2+2?", "<think>a</think>4", None, chat), ("2+2?", "4", None, chat)]) == [1.0, 0.0]
    # a text prompt: TRL's standard format, as TRL gives it; a reward that wants messages is told why it broke
    accuracy = load_reward_spec("trl.rewards:accuracy_reward")
    with pytest.raises(TypeError, match="it got TRL's standard format, text completions"):
        accuracy("2+2?", "4", None, {"solution": "4"})
