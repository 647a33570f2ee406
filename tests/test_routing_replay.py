"""Routing replay (R3): the engine records each sampled token's experts, the buffer keeps them beside
the token, and the learner routes the same tokens through the same experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.families import tiny_model
from slime.algorithms.batch import collate
from slime.buffer import TrajectoryStore
from slime.config import load_config
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.engines.routing import NO_ROUTE, replay_misfit, replayed_routing, routers_of
from slime.learner import Learner, response_logprobs
from slime.model import load_model
from slime.sample import Sample, Status
from tests.helpers import routers_choices

PROMPTS = [[6, 7, 77, 61, 86, 9, 12], [6, 7, 30, 31]]


def _generate(model, record: bool = True):
    engine = BuiltinEngine(model, record_routing=record)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    return engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])


def _sample(prompt, chunk, group="g") -> Sample:
    s = Sample(group_id=group, index=0, prompt_ids=prompt, max_new_tokens=12)
    s.append(chunk.token_ids, chunk.logprobs, 0)
    s.routing = np.frombuffer(b"".join(chunk.routing), dtype=np.uint8).reshape(len(chunk.token_ids), -1).copy()
    s.status, s.reward = Status.COMPLETED, 1.0
    return s


def test_the_engine_records_the_experts_that_sampled_each_token(tiny_model_dir):
    model = load_model(tiny_model_dir, "float32", "cpu")
    out = _generate(model)
    for i, prompt in enumerate(PROMPTS):
        chunk = out[f"r{i}"]
        recorded = np.frombuffer(b"".join(chunk.routing), dtype=np.uint8).reshape(len(chunk.token_ids), -1)
        # Token t was sampled from the logits at position len(prompt) - 1 + t.
        own = routers_choices(model, prompt + chunk.token_ids[:-1])[len(prompt) - 1 :]
        np.testing.assert_array_equal(recorded, own.numpy())
        assert recorded.shape[1] == 4 * 2  # 4 MoE layers x top-2


def test_a_model_the_engine_cannot_record_is_refused_naming_why():
    with pytest.raises(ValueError, match="no MoE router"):
        BuiltinEngine(tiny_model("llama"), record_routing=True)
    assert replay_misfit(tiny_model("llama")) == "the model has no MoE router"
    assert "softmax then top-k" in replay_misfit(tiny_model("deepseek_v3"))  # grouped, biased routing
    assert replay_misfit(tiny_model("mixtral")) is None  # renormalises: the same choice
    assert replay_misfit(tiny_model("qwen3_moe")) is None
    with pytest.raises(ValueError, match="rollout.engine=builtin"):
        load_config(None, ["learner.routing_replay=true", "rollout.engine=vllm"])


def test_the_learner_routes_the_recorded_tokens_through_the_recorded_experts(tiny_model_dir):
    model = load_model(tiny_model_dir, "float32", "cpu")
    out = _generate(model)
    batch = collate([_sample(p, out[f"r{i}"]) for i, p in enumerate(PROMPTS)], [0, 1], pad_id=0)
    plain = response_logprobs(model, batch, 1.0)[0]
    replayed = response_logprobs(model, batch, 1.0, replay=True)[0]
    mask = batch.mask > 0
    # The same weights chose these experts: replay changes nothing but float noise.
    torch.testing.assert_close(replayed[mask], plain[mask], atol=1e-5, rtol=0)
    engine = torch.tensor([lp for i in range(2) for lp in out[f"r{i}"].logprobs])
    torch.testing.assert_close(replayed[mask], engine, atol=2e-4, rtol=0)

    # Another router (the engine's weights before an update, or a near tie decided otherwise):
    # replay routes the recorded tokens through the recorded experts and nowhere else.
    other = load_model(tiny_model_dir, "float32", "cpu")
    with torch.no_grad():
        for r in routers_of(other):
            r.weight.mul_(-1.0)  # every token now prefers other experts
    assert replay_misfit(other) is None  # checks the router (a forward of its own) before the hooks
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: chosen.append(o[-1])) for r in routers_of(other)]
    with replayed_routing(other, batch.routing, batch.response_pos, batch.input_ids.shape[1]):
        logp = response_logprobs(other, batch, 1.0)[0]
    for h in hooks:
        h.remove()
    width = batch.input_ids.shape[1]
    for layer, experts in enumerate(chosen):
        experts = experts.reshape(2, width, 2)
        for row in range(2):
            n = int(batch.response_len[row])
            pos = batch.response_pos[row, :n]
            recorded = batch.routing[row, :n, 2 * layer : 2 * layer + 2].long()
            assert torch.equal(experts[row, pos], recorded)
    assert not torch.allclose(logp[mask], plain[mask])  # the router's own weights still weigh them
    logp[mask].sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers_of(other))


def test_the_buffer_keeps_each_tokens_experts_beside_it(buffer: TrajectoryStore):
    buffer.add_group([1, 2, 3], n=1, max_new_tokens=16, metadata={})
    sid = buffer.lease("w", 1)[0].id
    assert buffer.append_chunk(sid, "w", [10, 11], [-0.5, -0.25], 0, routing=bytes([1, 2, 3, 4])) == 2
    # An environment's tokens carry no record: they read as none.
    assert buffer.append_chunk(sid, "w", [12], [0.0], 0, loss_mask=0) == 3
    assert buffer.append_chunk(sid, "w", [13], [-0.1], 0, routing=bytes([5, 6])) == 4
    with pytest.raises(Exception, match="routing bytes"):  # another width: refused, nothing appended
        buffer.append_chunk(sid, "w", [14], [-0.1], 0, routing=bytes([1, 2, 3]))
    buffer.finish(sid, "w", Status.COMPLETED, reward=1.0)
    sample = buffer.get_sample(sid)
    assert sample.response_length == 4
    np.testing.assert_array_equal(sample.routing, [[1, 2], [3, 4], [NO_ROUTE, NO_ROUTE], [5, 6]])
    with pytest.raises(ValueError, match="do not divide"):
        buffer.append_chunk(sid, "w", [14, 15], [-0.1, -0.2], 0, routing=bytes([1, 2, 3]))


def test_a_learner_with_routing_replay_trains_on_recorded_experts(tiny_model_dir, redis_url, tmp_path):
    model = load_model(tiny_model_dir, "float32", "cpu")
    out = _generate(model)
    cfg = load_config(None, ["job_name=replay-learner", f"output_dir={tmp_path}", "learner.routing_replay=true"])
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    samples = [_sample(p, out[f"r{i}"], group="g") for i, p in enumerate(PROMPTS)]
    samples[1].reward = 0.0
    metrics = learner.update(samples, [0, 0], step=0)
    assert np.isfinite(metrics["loss"]) and metrics["mismatch_fresh_logp_abs_diff"] < 2e-4
    learner.close()
