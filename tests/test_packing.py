"""Padding-free micro-batches (slime/learner/packing.py): packed rows give every family the logprobs,
entropies and gradients of padded rows, a packing that leaks across rows is caught at start, and
the learner's update is the padded one's up to float rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_learner import GOLDEN_CASES, _golden_update, golden_model_dir  # noqa: F401
from test_routing_replay import PROMPTS, _generate, _sample
from transformers import AttentionInterface

from benchmarks.families import FAMILIES, tiny_model
from slime.algorithms.batch import collate
from slime.learner import packing, response_logprobs
from slime.learner.packing import PACKED, PackedRows, packing_misfit, use_packed_attention
from slime.model import load_model
from slime.sample import Sample, Status


def _batch(vocab: int, lengths: list[tuple[int, int]], seed: int = 0):
    """Rows of (prompt, response) lengths, random tokens, every response token trainable."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, (p, r) in enumerate(lengths):
        s = Sample(group_id="g", index=i, prompt_ids=rng.integers(3, vocab, p).tolist(), max_new_tokens=r)
        s.append(rng.integers(3, vocab, r).tolist(), np.zeros(r), 0)
        s.status, s.reward = Status.COMPLETED, float(i % 2)
        samples.append(s)
    return collate(samples, [0] * len(samples), pad_id=0)


# Rows longer than the tiny configs' sliding window (8), one with an empty response, three of one
# length (14 tokens: one attention call for the three).
LENGTHS = [(5, 9), (3, 2), (7, 14), (4, 0), (2, 6), (6, 8), (3, 11)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_give_each_family_the_padded_logprobs_and_gradients(family):
    model = tiny_model(family).train()
    for module in model.modules():  # dropout off: both ways must see the same function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    assert packing_misfit(model) is None
    batch = _batch(model.config.vocab_size, LENGTHS)
    mask = batch.mask > 0

    def run(packed: bool):
        """packed: one forward of all rows; else each row alone (transformers' own padded forward
        fails on DeepSeek-V2/V3's MLA with a padding mask), gradients summed over the rows."""
        model.zero_grad()
        parts = [batch] if packed else [batch.rows(torch.tensor([i])) for i in range(len(LENGTHS))]
        logps, entropies = [], []
        for part in parts:
            logp, entropy, _ = response_logprobs(model, part, 0.8, with_entropy=True, packed=packed)
            (logp * part.mask).sum().backward()
            width = batch.mask.shape[1]
            logps.append(torch.nn.functional.pad(logp.detach(), (0, width - logp.shape[1])))
            entropies.append(torch.nn.functional.pad(entropy.detach(), (0, width - entropy.shape[1])))
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        return torch.cat(logps), torch.cat(entropies), grads

    padded = run(False)
    use_packed_attention(model)
    packed = run(True)
    torch.testing.assert_close(packed[0][mask], padded[0][mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(packed[1][mask], padded[1][mask], atol=2e-5, rtol=0)
    for g_packed, g_padded in zip(packed[2], padded[2]):
        torch.testing.assert_close(g_packed, g_padded, atol=1e-5, rtol=1e-4)


def test_the_packed_layout_by_hand():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    rows = PackedRows.of(ids, torch.tensor([3, 2, 4]), torch.tensor([[1, 2], [0, 1], [2, 3]]))
    # Packed shortest first (rows of one length side by side make one attention call).
    assert rows.input_ids.tolist() == [[8, 9, 5, 6, 7, 1, 2, 3, 4]]
    assert rows.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert rows.cu_seqlens.tolist() == [0, 2, 5, 9]
    assert rows.max_len == 4
    # In the rows' own order. A response position past a row's end (padding) reads the row's last
    # token, never the next row.
    assert rows.logit_pos.tolist() == [[3, 4], [0, 1], [7, 8]]
    assert rows.last_pos.tolist() == [4, 1, 8]
    rows = PackedRows.of(ids[:1], torch.tensor([2]), torch.tensor([[1, 2, 3]]))
    assert rows.logit_pos.tolist() == [[1, 1, 1]]
    assert packing._runs([0, 2, 4, 7, 10, 11]) == [(0, 2, 2), (4, 2, 3), (10, 1, 1)]


def test_an_attention_that_leaks_across_rows_or_ignores_the_window_is_caught_at_start(monkeypatch):
    def across_rows(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(PACKED, across_rows)
    try:
        assert "differ from the model's own forward" in packing_misfit(tiny_model("llama"))
    finally:
        AttentionInterface.register(PACKED, packing.packed_attention)
    real_row_attention = packing._row_attention

    def no_window(q, k, v, scaling, dropout, window, softcap, sinks):
        return real_row_attention(q, k, v, scaling, dropout, None, softcap, sinks)

    monkeypatch.setattr(packing, "_row_attention", no_window)
    assert "differ" in packing_misfit(tiny_model("mistral"))  # rows longer than the window
    monkeypatch.undo()
    assert packing_misfit(tiny_model("mistral")) is None


def test_a_forward_that_was_not_packed_is_refused_naming_why():
    model = tiny_model("qwen3")
    use_packed_attention(model)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[4, 5, 6]]))


def test_activation_checkpointing_recomputes_the_packed_rows(tiny_model_dir):
    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model = load_model(tiny_model_dir, "float32", "cpu").train()
        use_packed_attention(model)
        if checkpointing:
            model.gradient_checkpointing_enable()
        batch = _batch(model.config.vocab_size, LENGTHS, seed=1)
        logp, _, _ = response_logprobs(model, batch, 1.0, packed=True)
        (logp * batch.mask).sum().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_routing_replay_through_packed_rows(tiny_model_dir):
    model = load_model(tiny_model_dir, "float32", "cpu")
    out = _generate(model)
    batch = collate([_sample(p, out[f"r{i}"]) for i, p in enumerate(PROMPTS)], [0, 1], pad_id=0)
    padded = response_logprobs(model, batch, 1.0, replay=True)[0]
    use_packed_attention(model)
    packed = response_logprobs(model, batch, 1.0, replay=True, packed=True)[0]
    mask = batch.mask > 0
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    engine = torch.tensor([lp for i in range(2) for lp in out[f"r{i}"].logprobs])
    torch.testing.assert_close(packed[mask], engine, atol=2e-4, rtol=0)


# Float rounding only: the near-cancelling parameter checksums (Adam's first step follows the sign
# of gradients that are noise) and near-zero means are left out.
CHAOTIC = {"param_weighted", "advantage_mean", "learner_packed"}


@pytest.mark.parametrize("case", ["grpo", "ppo"])
def test_the_packed_learner_takes_the_padded_learners_update(golden_model_dir, redis_url, tmp_path, case, monkeypatch):  # noqa: F811
    import test_learner

    runs = {}
    for packed in (True, False):
        monkeypatch.setattr(test_learner, "GOLDEN_COMMON", [*test_learner.GOLDEN_COMMON, f"learner.packing={packed}"])
        runs[packed] = _golden_update(case, golden_model_dir, redis_url, tmp_path / str(packed))
    assert runs[True]["learner_packed"] == 1.0 and runs[False]["learner_packed"] == 0.0
    compared = [k for k, v in runs[False].items() if isinstance(v, float) and k not in CHAOTIC]
    assert {"loss", "pg_loss", "entropy", "grad_norm", "param_abs_delta"} <= set(compared)
    if GOLDEN_CASES[case][0][0] == "algorithm.name=ppo":
        assert {"vf_loss", "critic_grad_norm", "critic_abs_delta"} <= set(compared)
    for k in compared:
        assert runs[True][k] == pytest.approx(runs[False][k], rel=5e-4, abs=1e-6), k
