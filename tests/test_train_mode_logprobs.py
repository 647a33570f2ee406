"""The learner computes log π with its policy in train mode (activation checkpointing, LoRA's own
dropout); the engine and the weight-sync probe in eval mode. After `disable_dropout` the two must be
one function of the weights for every family, or every update trains on a gap the probe never sees.
Released configs that set what the tiny defaults leave at 0: StarCoder2 (residual and embedding
dropout 0.1), Seed-OSS (residual dropout 0.1, transformers' default too), Phi-3.5-MoE (router and
input jitter 0.01: in train mode PhiMoE samples its experts with Gumbel noise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.families import tiny_model
from slime.algorithms.batch import collate
from slime.learner import response_logprobs
from slime.model import disable_dropout
from slime.sample import Sample

# family -> (config overrides, a name disable_dropout must report)
CASES = {
    "seed_oss": ({}, "residual_dropout"),
    "starcoder2": ({"residual_dropout": 0.1, "embedding_dropout": 0.1, "attention_dropout": 0.1}, "embedding_dropout"),
    "phimoe": ({"router_jitter_noise": 0.01, "input_jitter_noise": 0.01}, "mlp.router (routing noise in train mode)"),
}


def _batch(vocab: int):
    rng = np.random.default_rng(0)
    samples = []
    for i, (p, r) in enumerate([(5, 7), (9, 3)]):
        s = Sample(group_id="g", index=i, prompt_ids=rng.integers(3, vocab, p).tolist(), max_new_tokens=r)
        s.append(rng.integers(3, vocab, r).tolist(), np.zeros(r), 0)
        samples.append(s)
    return collate(samples, [0, 0], pad_id=0)


@pytest.mark.parametrize("family", list(CASES))
def test_train_mode_logprobs_are_the_eval_ones_after_disable_dropout(family):
    torch.manual_seed(0)
    overrides, reported = CASES[family]
    model = tiny_model(family, 97, **overrides)
    dropped = disable_dropout(model)
    assert any(reported in name for name in dropped), dropped
    batch = _batch(97)
    with torch.no_grad():
        model.eval()
        want = response_logprobs(model, batch, 1.0)[0]
        model.train()  # as LearnerActor: π_old and π
        got = [response_logprobs(model, batch, 1.0)[0] for _ in range(2)]
    for g in got:
        torch.testing.assert_close(g, want, rtol=0, atol=1e-6)
    assert disable_dropout(model) == []


def test_a_noise_disable_dropout_does_not_know_shows_as_a_train_mode_gap():
    """train_mode_gap is 0 once disable_dropout has run on a family it knows; a layer that adds noise
    in training under a name it does not know gives a gap (the learner warns at start)."""
    from slime.learner.actor import TRAIN_MODE_GAP_TOLERANCE
    from slime.model import train_mode_gap

    torch.manual_seed(0)
    model = tiny_model("starcoder2", 97, residual_dropout=0.1)
    assert train_mode_gap(model) > 1e-3  # its residual dropout, before disable_dropout
    disable_dropout(model)
    assert train_mode_gap(model) == 0.0
    model.train()

    def noisy(module, args, output):  # a decoder layer returns its hidden states (transformers 5)
        return output + 0.01 * torch.randn_like(output) if module.training else output

    model.model.layers[0].register_forward_hook(noisy)
    assert train_mode_gap(model) > TRAIN_MODE_GAP_TOLERANCE[torch.float32]
    assert model.training  # the model's mode is kept
