"""Reward model (Bradley-Terry) and process reward model on the tiny MoE with the char tokenizer."""

from __future__ import annotations

import importlib.util
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from rewards.prm import (
    ProcessRewardModel,
    aggregate,
    prm_reward,
    step_end_tokens_of_ids,
    step_spans,
    tokenize_with_step_ends,
)
from rewards.reward_model import RewardModel, rm_reward
from rewards.training.common import DataError
from rewards.training.prm import main_train_prm, train_prm
from rewards.training.reward_model import main_train_rm, train_reward_model

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent


def _load_example_module():
    spec = importlib.util.spec_from_file_location("make_preference_data", ROOT / "examples" / "make_preference_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mpd = _load_example_module()


# ----------------------------------------------------------------------------- data generators


def test_generated_data_is_well_formed():
    pairs = mpd.make_preference_pairs(50, seed=0)
    for r in pairs:
        pattern, n = r["prompt"].rstrip("=").split("*")
        assert r["chosen"] == pattern * int(n)
        assert r["rejected"] != r["chosen"] and r["rejected"]
    for r in mpd.make_prm_examples(50, seed=0):
        assert len(r["steps"]) == len(r["labels"])
        # 1s while correct, 0 from the first error on
        first_zero = r["labels"].index(0) if 0 in r["labels"] else len(r["labels"])
        assert r["labels"] == [1] * first_zero + [0] * (len(r["labels"]) - first_zero)
        pattern = r["prompt"].split("*")[0]
        assert all(s == pattern for s in r["steps"][:first_zero])


# ----------------------------------------------------------------------------- reward model


def test_rm_learns_to_rank_held_out_pairs(tiny_model_dir, tmp_path):
    data = mpd.write_jsonl(mpd.make_preference_pairs(160, seed=0, kinds=("foreign",)), tmp_path / "pairs.jsonl")
    result = train_reward_model(
        tiny_model_dir, data, tmp_path / "rm", steps=30, lr=2e-3, batch_size=8, eval_fraction=0.25, seed=0
    )
    assert result["eval_pairs"] == 40 and result["train_pairs"] == 120
    assert result["eval_accuracy"] > 0.8, result
    assert result["final_loss"] < result["first_loss"]

    # Fresh pairs (other seed): the native-signature scorer prefers the correct answer.
    fn = rm_reward(tmp_path / "rm")
    fresh = mpd.make_preference_pairs(20, seed=123, kinds=("foreign",))
    wins = sum(fn(r["prompt"], r["chosen"], None, {}) > fn(r["prompt"], r["rejected"], None, {}) for r in fresh)
    assert wins / len(fresh) > 0.7
    batch = fn.score_batch([r["prompt"] for r in fresh], [r["chosen"] for r in fresh])
    single = [fn(r["prompt"], r["chosen"]) for r in fresh]
    assert np.allclose(batch, single, atol=1e-5)  # padding does not change a score

    # Thread safety: concurrent calls give the serial answers.
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda r: fn(r["prompt"], r["chosen"], None, {}), fresh))
    assert np.allclose(threaded, single, atol=1e-5)


def test_rm_save_load_round_trip(tiny_model_dir, tmp_path):
    rm = RewardModel.from_backbone(tiny_model_dir, seed=3)
    prompts, responses = ["ab*3=", "c*2=", "abc*1="], ["ababab", "cc", "abx"]
    before = rm.score(prompts, responses)
    rm.save(tmp_path / "rm")
    assert (tmp_path / "rm" / "reward_model.json").is_file() and (tmp_path / "rm" / "config.json").is_file()
    after = RewardModel.load(tmp_path / "rm").score(prompts, responses)
    assert np.allclose(before, after, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="reward_model.json"):
        RewardModel.load(tiny_model_dir)


# ----------------------------------------------------------------------------- PRM: steps -> tokens


def test_step_spans():
    assert step_spans("ab|ab|ax", "|") == [(0, 2), (3, 5), (6, 8)]
    assert step_spans("ab||ab|", "|") == [(0, 2), (4, 6)]  # blank segments are not steps
    assert step_spans("one\n\ntwo\n", "\n") == [(0, 3), (5, 8)]
    assert step_spans("", "\n") == []


def test_prm_rewards_land_on_step_end_tokens(tiny_model_dir):
    prm = ProcessRewardModel.from_backbone(tiny_model_dir, seed=1, delimiter="|")
    tok = prm.tokenizer
    prompt, response = "ab*3=", "ab|ab|ax"
    # char tokenizer: token i is character i, so the steps end on tokens 1, 4 and 7
    from_text = prm.token_rewards(prompt, response=response)
    assert from_text.token_indices == [1, 4, 7]
    assert from_text.steps == ["ab", "ab", "ax"]
    assert from_text.response_ids == tok(response, add_special_tokens=False)["input_ids"]

    # the policy's sampled ids (with EOS at the end): same placement, EOS gets nothing
    ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    sr = prm.token_rewards(prompt, response_ids=ids)
    assert sr.token_indices == [1, 4, 7]
    expected = np.zeros(len(ids), dtype=np.float32)
    expected[[1, 4, 7]] = sr.scores
    assert sr.token_rewards.shape == (9,) and np.array_equal(sr.token_rewards, expected)
    assert all(0.0 < s < 1.0 for s in sr.scores)
    assert np.allclose(sr.scores, from_text.scores)

    # the scores are the head at exactly those positions of prompt + response
    seq = tok(prompt + response, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hidden = prm.backbone(input_ids=torch.tensor([seq])).last_hidden_state[0]
        direct = torch.sigmoid(prm.head(hidden).squeeze(-1))[[len(prompt) + 1, len(prompt) + 4, len(prompt) + 7]]
    assert np.allclose(sr.scores, direct.tolist(), atol=1e-5)

    # blank segments and a trailing delimiter: steps end on characters 1 and 5
    assert prm.token_rewards(prompt, response="ab||ab|").token_indices == [1, 5]
    # no steps at all: no rewards
    empty = prm.token_rewards(prompt, response_ids=[tok.eos_token_id])
    assert empty.scores == [] and np.array_equal(empty.token_rewards, np.zeros(1, dtype=np.float32))


class _PairTokenizer:
    """A slow tokenizer whose tokens are 2-character chunks (the step end can sit mid-token)."""

    is_fast = False

    def __call__(self, text, add_special_tokens=False):
        return {
            "input_ids": [
                ord(text[i]) * 1000 + (ord(text[i + 1]) if i + 1 < len(text) else 0) for i in range(0, len(text), 2)
            ]
        }

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(t // 1000) + (chr(t % 1000) if t % 1000 else "") for t in ids)


def test_step_end_mapping_with_multi_char_tokens():
    tok = _PairTokenizer()
    text = "ab|ab|ax"  # tokens: "ab" "|a" "b|" "ax"; step ends at chars 1, 4, 7
    ends = [e - 1 for _, e in step_spans(text, "|")]
    ids, idx = tokenize_with_step_ends(tok, text, ends)  # re-tokenised prefixes
    assert len(ids) == 4 and idx == [0, 2, 3]
    assert step_end_tokens_of_ids(tok, ids, ends) == [0, 2, 3]  # decoded prefixes


def test_aggregation_by_hand():
    s = [0.9, 0.5, 0.8]
    assert aggregate(s, "min") == 0.5
    assert aggregate(s, "last") == 0.8
    assert math.isclose(aggregate(s, "mean"), 2.2 / 3)
    assert math.isclose(aggregate(s, "product"), 0.36)
    assert aggregate([], "min") == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(s, "max")


def test_prm_training_and_reward(tiny_model_dir, tmp_path):
    data = mpd.write_jsonl(mpd.make_prm_examples(120, seed=1), tmp_path / "steps.jsonl")
    result = train_prm(
        tiny_model_dir,
        data,
        tmp_path / "prm",
        steps=20,
        lr=2e-3,
        batch_size=8,
        eval_fraction=0.25,
        seed=0,
        delimiter="|",
    )
    assert result["eval_examples"] == 30 and 0.0 <= result["eval_step_accuracy"] <= 1.0
    assert result["final_loss"] < result["first_loss"]
    fn = prm_reward(tmp_path / "prm", aggregation="min")
    assert fn.model.delimiter == "|"
    steps = fn.step_scores(["ab*2="], ["ab|ab"])[0]
    assert len(steps) == 2
    assert math.isclose(fn("ab*2=", "ab|ab", "abab", {}), min(steps), rel_tol=1e-6)


# ----------------------------------------------------------------------------- bad data, CLI


GOOD_PAIR = {"prompt": "ab*2=", "chosen": "abab", "rejected": "abx"}


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"prompt": "ab*2=", "chosen": "abab"}', "missing key 'rejected'"),
        ('{"prompt": "ab*2=", "chosen": "", "rejected": "ab"}', "'chosen' is empty"),
        ('{"prompt": "ab*2=", "chosen": "ab", "rejected": "ab"}', "identical"),
        ('{"prompt": "ab*2=", "chosen": 3, "rejected": "ab"}', "must be a string"),
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_preference_line_names_file_and_line(tiny_model_dir, tmp_path, line, why):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD_PAIR) + "\n\n" + line + "\n")  # the bad line is line 3
    with pytest.raises(DataError) as e:
        train_reward_model(tiny_model_dir, path, tmp_path / "out", steps=1)
    assert str(e.value).startswith(f"{path}:3: ") and why in str(e.value)


@pytest.mark.parametrize(
    "obj, why",
    [
        ({"prompt": "a*2=", "steps": ["a", "a"]}, "missing key 'labels'"),
        ({"prompt": "a*2=", "steps": ["a", "a"], "labels": [1]}, "one label per step"),
        ({"prompt": "a*2=", "steps": ["a", ""], "labels": [1, 1]}, "steps[1] is empty"),
        ({"prompt": "a*2=", "steps": ["a|a"], "labels": [1]}, "delimiter"),
        ({"prompt": "a*2=", "steps": ["a"], "labels": [2]}, "labels[0] must be 0 or 1"),
    ],
)
def test_bad_prm_line_names_file_and_line(tiny_model_dir, tmp_path, obj, why):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"prompt": "a*1=", "steps": ["a"], "labels": [1]}) + "\n" + json.dumps(obj) + "\n")
    with pytest.raises(DataError) as e:
        train_prm(tiny_model_dir, path, tmp_path / "out", steps=1, delimiter="|")
    assert str(e.value).startswith(f"{path}:2: ") and why in str(e.value)


def test_cli_hooks(tiny_model_dir, tmp_path, capsys):
    pairs = mpd.write_jsonl(mpd.make_preference_pairs(12, seed=0), tmp_path / "pairs.jsonl")
    base = ["--model-dir", str(tiny_model_dir), "--steps", "2", "--batch-size", "2", "--log-every", "0"]
    assert main_train_rm(base + ["--data", str(pairs), "--out", str(tmp_path / "rm")]) == 0
    assert '"eval_accuracy"' in capsys.readouterr().out
    assert (tmp_path / "rm" / "score_head.safetensors").is_file()
    steps = mpd.write_jsonl(mpd.make_prm_examples(12, seed=0), tmp_path / "steps.jsonl")
    assert main_train_prm(base + ["--data", str(steps), "--out", str(tmp_path / "prm"), "--delimiter", "|"]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert main_train_rm(base + ["--data", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert f"{bad}:1:" in capsys.readouterr().out


def test_a_step_score_that_ends_in_an_observation_moves_to_a_trainable_token():
    """In a multi-turn transcript a step may end inside an observation (loss mask 0), where GAE's
    mask dropped its score: the sample trained with reward 0 and nothing said so. The score moves to
    the last trainable token before it, else the first one after."""
    from types import SimpleNamespace

    from rewards.runner import StepScores
    from slime.model import build_char_tokenizer
    from slime.rollout.worker import RolloutWorker
    from slime.sample import Sample

    tokenizer = build_char_tokenizer()
    ids = tokenizer("abcdefgh", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8  # one token per character
    sample = Sample(group_id="g", index=0, prompt_ids=[1], max_new_tokens=16)
    sample.append(ids[:2], np.zeros(2), 0, loss_mask=1)  # model: "ab"
    sample.append(ids[2:5], np.zeros(3), 0, loss_mask=0)  # observation: "cde"
    sample.append(ids[5:], np.zeros(3), 0, loss_mask=1)  # model: "fgh"
    worker = SimpleNamespace(tokenizer=tokenizer, params=SimpleNamespace(stop_token_ids=[]))
    steps = StepScores(scores=(0.25, 0.5, 1.0), ends=(3, 6, 7))  # "d" (observation), "g", "h"
    rewards = RolloutWorker._step_rewards_on_tokens(worker, sample, steps)
    assert rewards.tolist() == [0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0]
    sample.loss_mask[:2] = 0  # nothing trainable before the observation: the first trainable after
    rewards = RolloutWorker._step_rewards_on_tokens(worker, sample, StepScores(scores=(0.25,), ends=(3,)))
    assert rewards.tolist() == [0.0] * 5 + [0.25, 0.0, 0.0]
