"""The learner at long lengths (slime/learner/forwards.py): log π and the entropy computed from the
head's input a chunk of positions at a time equal those of whole logits, gradients included, packed
and padded; no [T, V] tensor is built; a model whose logits the chunks cannot reproduce keeps whole
logits; the learner chunks by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.families import FAMILIES, tiny_model
from slime.algorithms.batch import collate
from slime.config import LearnerConfig, load_config
from slime.learner import Learner
from slime.learner.forwards import LOGIT_CHUNK, ValueModel, response_logprobs, use_logit_chunks
from slime.learner.packing import packing_misfit, use_packed_attention
from slime.model import load_model
from slime.sample import Sample, Status

# (prompt, response) lengths: 7 rows, one with an empty response; 4 rows x 14 positions = 56 logits
# padded, a chunk of 5 divides neither.
LENGTHS = [(5, 9), (3, 2), (7, 14), (4, 0), (2, 6), (6, 8), (3, 11)]
CHUNK = 5


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0):
    rng = np.random.default_rng(seed)
    samples = []
    for i, (p, r) in enumerate(lengths):
        s = Sample(group_id="g", index=i, prompt_ids=rng.integers(3, vocab, p).tolist(), max_new_tokens=r)
        s.append(rng.integers(3, vocab, r).tolist(), np.zeros(r), 0)
        s.status, s.reward = Status.COMPLETED, float(i % 2)
        samples.append(s)
    return collate(samples, [0] * len(samples), pad_id=0)


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():  # both ways must see the same function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _forward_backward(model, batch, chunk: int, packed: bool, **kwargs):
    """log π, entropy and every parameter's gradient of Σ mask (log π + 0.3 H)."""
    model.zero_grad()
    logp, entropy, _ = response_logprobs(
        model, batch, 0.8, with_entropy=True, packed=packed, chunk_tokens=chunk, **kwargs
    )
    ((logp + 0.3 * entropy) * batch.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def _assert_same(whole, chunked, mask) -> None:
    (lw, ew, gw), (lc, ec, gc) = whole, chunked
    torch.testing.assert_close(lc[mask], lw[mask], rtol=0, atol=5e-6)
    torch.testing.assert_close(ec[mask], ew[mask], rtol=0, atol=2e-5)
    assert gw.keys() == gc.keys() and gw
    for name, g in gw.items():  # relative to the largest entry of each gradient
        assert (gc[name] - g).abs().max() <= 1e-5 * g.abs().max().clamp_min(1e-12), name


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_chunked_logprobs_entropy_and_gradients_equal_whole_logits_on_the_tiny_model(tiny_model_dir, packed):
    model = _no_dropout(load_model(tiny_model_dir))
    if packed:
        assert packing_misfit(model) is None
        use_packed_attention(model)
    batch = _batch(model.config.vocab_size)
    whole = _forward_backward(model, batch, 0, packed)
    chunked = _forward_backward(model, batch, CHUNK, packed)
    _assert_same(whole, chunked, batch.mask > 0)
    assert chunked[0].shape == batch.mask.shape
    # without the graph (the reference, π_old) and without the entropy: the same log π
    with torch.no_grad():
        logp, entropy, _ = response_logprobs(model, batch, 0.8, packed=packed, chunk_tokens=CHUNK)
    assert entropy is None
    torch.testing.assert_close(logp[batch.mask > 0], whole[0][batch.mask > 0], rtol=0, atol=5e-6)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("gemma2", {"final_logit_softcapping": 0.5}),  # soft-capped: cap · tanh(z / cap)
        ("cohere", {}),  # logit_scale 0.0625
        ("granite", {}),  # logits_scaling 2 (benchmarks/families.py sets it off 1)
        ("qwen3", {"tie_word_embeddings": True}),  # the head is the input embedding
    ],
)
def test_chunked_equals_whole_logits_for_families_that_scale_or_cap_their_logits(family, overrides):
    model = _no_dropout(tiny_model(family, **overrides))
    assert use_logit_chunks(model, CHUNK) is None
    batch = _batch(model.config.vocab_size, seed=1)
    for packed in (False, True):
        if packed:
            use_packed_attention(model)
        _assert_same(
            _forward_backward(model, batch, 0, packed), _forward_backward(model, batch, CHUNK, packed), batch.mask > 0
        )


@pytest.mark.parametrize("family", [*FAMILIES, "cohere", "granite", "granitemoe"])
def test_every_family_takes_the_chunked_path_packed(family):
    """The start check passes for every curated family and the scaled ones, on packed rows (as the
    learner runs them; DeepSeek-V2/V3's own padded forward fails, see docs/learner.md)."""
    model = tiny_model(family)
    assert packing_misfit(model) is None
    use_packed_attention(model)
    assert use_logit_chunks(model, CHUNK) is None and getattr(model, LOGIT_CHUNK) == CHUNK


def test_routing_replay_still_wraps_the_body_forward(tiny_model_dir):
    model = _no_dropout(load_model(tiny_model_dir))
    batch = _batch(model.config.vocab_size, seed=2)
    n, t = batch.response_ids.shape
    layers, k, experts = model.config.num_hidden_layers, model.config.num_experts_per_tok, model.config.num_experts
    batch.routing = (
        torch.stack(
            [torch.randperm(experts, generator=torch.Generator().manual_seed(i))[:k] for i in range(n * t * layers)]
        )
        .to(torch.uint8)
        .view(n, t, layers * k)
    )
    mask = batch.mask > 0
    for packed in (False, True):
        if packed:
            use_packed_attention(model)
        whole = _forward_backward(model, batch, 0, packed, replay=True)
        chunked = _forward_backward(model, batch, CHUNK, packed, replay=True)
        _assert_same(whole, chunked, mask)
        own = _forward_backward(model, batch, CHUNK, packed)  # the model's own routing: other numbers
        assert (own[0][mask] - chunked[0][mask]).abs().max() > 1e-3


def test_an_empty_pass_gives_the_head_a_zero_gradient_as_whole_logits_do(tiny_model_dir):
    """A rank with fewer micro-batches runs a forward and backward times 0 (Learner._empty_pass):
    every gradient must exist, zero, as on the other ranks (FSDP2 reduce-scatters the ones that do)."""
    model = _no_dropout(load_model(tiny_model_dir))
    batch = _batch(model.config.vocab_size)
    for chunk in (0, CHUNK):
        model.zero_grad(set_to_none=True)
        logp, _, _ = response_logprobs(model, batch, 0.8, chunk_tokens=chunk)
        (logp.sum() * 0.0).backward()
        head = model.get_output_embeddings().weight
        assert head.grad is not None and not head.grad.any(), chunk


class _Shapes(TorchDispatchMode):
    """The shape of every tensor any op returns, forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [x.shape for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        return out


def _vocab_rows(shapes, vocab: int, hidden: int) -> int:
    """The most positions of any [..., V] tensor (not the head weight's gradient, [H, V] in the matmul)."""
    return max((s[:-1].numel() for s in shapes if len(s) and s[-1] == vocab and s != (hidden, vocab)), default=0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_tensor_holds_more_than_one_chunk_of_logits_and_the_critic_none(tiny_model_dir, packed):
    policy = _no_dropout(load_model(tiny_model_dir))
    critic = ValueModel(str(tiny_model_dir), torch.float32)
    if packed:
        use_packed_attention(policy)
        use_packed_attention(critic.backbone)
        critic.packed = True
    vocab, hidden = policy.config.vocab_size, policy.config.hidden_size
    assert vocab not in (policy.config.hidden_size, policy.config.intermediate_size)
    batch = _batch(vocab)
    positions = int(batch.response_ids.numel())
    for chunk, most in [(0, positions), (4, 4)]:
        with _Shapes() as seen:
            logp, entropy, _ = response_logprobs(
                policy, batch, 0.8, with_entropy=True, packed=packed, chunk_tokens=chunk
            )
            (logp.sum() + entropy.sum()).backward()
        assert _vocab_rows(seen.shapes, vocab, hidden) == most, chunk  # whole logits: the detector sees them
    with _Shapes() as seen:
        values, last = critic(batch, with_last=True)
        (values.sum() + last.sum()).backward()
    assert _vocab_rows(seen.shapes, vocab, hidden) == 0


def test_a_model_with_an_unknown_logit_transform_keeps_whole_logits():
    model = tiny_model("llama").train()
    forward = model.forward

    def scaled(*args, **kwargs):  # a family whose forward rescales its logits in a way not known
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    model.forward = scaled
    why = use_logit_chunks(model, 2048)
    assert "differ from its own logits" in why and getattr(model, LOGIT_CHUNK) == 0
    assert model.training  # the check leaves the mode as it was
    batch = _batch(model.config.vocab_size)
    logp, _, _ = response_logprobs(model, batch, 1.0)  # the model's setting: whole logits, scaled
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.log_softmax(logits.gather(1, batch.response_pos[..., None].expand(-1, -1, logits.shape[-1])), -1)
    expected = expected.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logp.detach()[batch.mask > 0], expected[batch.mask > 0], rtol=0, atol=1e-5)
    assert use_logit_chunks(tiny_model("llama"), 0) == "learner.logit_chunk_tokens=0"


def test_the_learner_chunks_by_default(tiny_model_dir, redis_url, tmp_path):
    assert LearnerConfig().logit_chunk_tokens == 2048
    cfg = load_config(None, ["job_name=long-context", f"output_dir={tmp_path}", "algorithm.kl_coef=0.01"])
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    try:
        assert learner.logit_chunk_misfit is None
        assert getattr(learner.policy, LOGIT_CHUNK) == 2048 and getattr(learner.ref, LOGIT_CHUNK) == 2048
    finally:
        learner.buffer.delete_job()
        learner.close()
    cfg = load_config(None, ["job_name=long-context-off", f"output_dir={tmp_path}", "learner.logit_chunk_tokens=0"])
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    try:
        assert getattr(learner.policy, LOGIT_CHUNK) == 0
    finally:
        learner.buffer.delete_job()
        learner.close()
