"""Routing replay with activation checkpointing: the layer recomputed in backward routes through the
replayed experts, as its forward did, although backward runs after the forward's replay has ended.
And the critic's backbone, loaded without the policy's head, reports nothing of that head."""

from __future__ import annotations

import io
import logging

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from benchmarks.families import tiny_model
from slime.algorithms.batch import collate
from slime.config import load_config
from slime.engines.routing import replay_misfit, routers_of
from slime.learner import Learner, response_logprobs
from slime.learner.forwards import ValueModel, checkpoint_activations
from slime.model import load_model
from slime.sample import Sample, Status
from tests.helpers import routers_choices

PROMPTS = [[6, 7, 77, 61, 86, 9, 12], [6, 7, 30, 31]]
RESPONSES = [[11, 40, 52, 3, 19, 23, 8], [44, 45, 17, 90, 2]]


def _batch(model, seed: int = 0):
    """Two rows whose recorded experts are never the ones the model's routers would choose."""
    rng = np.random.default_rng(seed)
    experts = int(routers_of(model)[0].num_experts)
    samples = []
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        ids = prompt + response[:-1]
        own = routers_choices(model, ids).view(len(ids), len(routers_of(model)), -1)[
            len(prompt) - 1 :
        ]  # [T, layers, k]
        routing = np.empty(tuple(own.shape), dtype=np.uint8)
        for t, layer in np.ndindex(own.shape[:2]):
            others = [e for e in range(experts) if e not in own[t, layer].tolist()]
            routing[t, layer] = rng.permutation(others)[: own.shape[-1]]
        s = Sample(group_id="g", index=i, prompt_ids=prompt, max_new_tokens=len(response))
        s.append(response, -rng.random(len(response)), 0)
        s.routing = routing.reshape(len(response), -1)
        s.status, s.reward = Status.COMPLETED, float(i)
        samples.append(s)
    return samples, collate(samples, [0, 1], pad_id=0)


def _loss_and_grads(model, batch, replay: bool, checkpointed: bool):
    model.train()
    if checkpointed:
        checkpoint_activations(model)
    else:
        model.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    logp, entropy, _ = response_logprobs(model, batch, 1.0, with_entropy=True, replay=replay, chunk_tokens=0)
    mask = batch.mask > 0
    loss = -(logp[mask] * torch.linspace(0.5, 1.5, int(mask.sum()))).sum() - 0.1 * entropy[mask].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_checkpointed_gradients_under_replay_equal_the_uncheckpointed_ones():
    model = tiny_model("qwen3_moe", vocab_size=100)
    _, batch = _batch(model)
    loss, grads = _loss_and_grads(model, batch, replay=True, checkpointed=False)
    loss_ckpt, grads_ckpt = _loss_and_grads(model, batch, replay=True, checkpointed=True)
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # The replayed experts are not the routers' own: without replay the numbers differ.
    own_loss, own_grads = _loss_and_grads(model, batch, replay=False, checkpointed=True)
    assert not torch.allclose(own_loss, loss)
    router = next(n for n in grads if "gate" in n and "experts" not in n)
    assert not torch.allclose(own_grads[router], grads[router])


def test_the_recomputation_in_backward_routes_through_the_replayed_experts():
    model = tiny_model("qwen3_moe", vocab_size=100)
    _, batch = _batch(model, seed=1)
    model.train()
    checkpoint_activations(model)
    assert replay_misfit(model) is None  # checks the router (a forward of its own) before the hooks
    routers = routers_of(model)
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [
        r.register_forward_hook(lambda m, i, out, layer=layer: calls[layer].append(out[-1].detach().clone()))
        for layer, r in enumerate(routers)
    ]
    logp, _, _ = response_logprobs(model, batch, 1.0, replay=True, chunk_tokens=0)
    assert all(len(c) == 1 for c in calls)  # the forward
    logp[batch.mask > 0].sum().backward()
    for h in hooks:
        h.remove()
    k, width = 2, batch.input_ids.shape[1]
    for layer, (forward, recomputed) in enumerate(calls):
        assert torch.equal(recomputed, forward)  # the recomputation chose what the forward did
        experts = recomputed.reshape(2, width, k)
        for row in range(2):
            n = int(batch.response_len[row])
            recorded = batch.routing[row, :n, k * layer : k * (layer + 1)].long()
            assert torch.equal(experts[row, batch.response_pos[row, :n]], recorded)
    # out of the forward and its backward, the routers are their own again
    assert all("forward" not in r.__dict__ for r in routers)


def test_a_learner_with_both_options_takes_the_uncheckpointed_step(tiny_model_dir, redis_url, tmp_path):
    """The learner's own update (actor._optimize) with both options: no CheckpointError, and the
    same gradient norm as without checkpointing."""
    samples, _ = _batch(load_model(tiny_model_dir, "float32", "cpu"), seed=2)  # experts it would not choose
    norms = []
    for i, ckpt in enumerate(("false", "true")):
        cfg = load_config(
            None,
            [
                f"job_name=replay-ckpt-{i}",
                f"output_dir={tmp_path / str(i)}",
                "learner.routing_replay=true",
                f"learner.activation_checkpointing={ckpt}",
            ],
        )
        learner = Learner(cfg, str(tiny_model_dir), redis_url)
        metrics = learner.update(samples, [0, 0], step=0)
        assert np.isfinite(metrics["loss"])
        norms.append(metrics["grad_norm"])
        learner.close()
    assert abs(norms[1] - norms[0]) <= 1e-5 * max(1.0, abs(norms[0]))


def test_the_critic_loads_its_backbone_without_a_report_of_the_head_it_leaves_out(tmp_path):
    """The critic's backbone leaves the policy's lm_head out on purpose: transformers' load report
    of it is not shown, while a report naming anything else still is."""
    tiny_model("qwen3_moe", vocab_size=100, tie_word_embeddings=False).save_pretrained(tmp_path)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("transformers").addHandler(handler)
    try:
        ValueModel(str(tmp_path), torch.float32)
        assert "LOAD REPORT" not in stream.getvalue()
        weights = load_file(tmp_path / "model.safetensors")
        del weights[next(k for k in weights if k.endswith("layers.0.self_attn.q_proj.weight"))]
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
        ValueModel(str(tmp_path), torch.float32)
        assert "LOAD REPORT" in stream.getvalue() and "MISSING" in stream.getvalue()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
