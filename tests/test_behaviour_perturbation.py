"""rollout.behaviour_perturbation: a train-inference gap on purpose. The built-in engine samples from a
perturbed policy and reports the logprobs of the distribution it sampled from (token_sampler.py);
the learner then measures a KL(μ ‖ π_old) well above the engine's own numerics. vLLM and SGLang
refuse the option at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime.algorithms.batch import collate
from slime.algorithms.mismatch import MismatchMeter
from slime.config import ConfigError, load_config
from slime.engines.builtin import BuiltinEngine
from slime.engines.builtin.token_sampler import sample_tokens
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.learner.forwards import response_logprobs
from slime.model import load_model
from slime.sample import Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sample(logits: torch.Tensor, greedy: torch.Tensor, seed: int, **perturbation) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    generator = torch.Generator().manual_seed(seed)
    return sample_tokens(
        logits,
        torch.full((n,), 0.8),
        greedy,
        torch.zeros(n, dtype=torch.long),
        torch.ones(n),
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        generator=generator,
        **perturbation,
    )


def test_the_sampler_reports_the_logprobs_of_the_perturbed_distribution_it_sampled() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 4
    greedy = torch.tensor([False, False, False, False, False, True])
    plain_tok, plain_lp = _sample(logits, greedy, 1)
    assert torch.equal(torch.stack(_sample(logits, greedy, 1, perturbation="none")), torch.stack((plain_tok, plain_lp)))

    tok, lp = _sample(logits, greedy, 1, perturbation="bf16_logits")
    want = torch.log_softmax(logits.to(torch.bfloat16).float() / 0.8, -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.equal(lp[:5], want[:5])
    assert not torch.allclose(lp[:5], torch.log_softmax(logits / 0.8, -1).gather(1, tok[:5, None]).squeeze(1))

    tok, lp = _sample(logits, greedy, 1, perturbation="temperature_noise", perturbation_scale=0.3)
    z = torch.randn(6, generator=torch.Generator().manual_seed(1))  # drawn first, from the same generator
    temp = 0.8 * torch.exp(0.3 * z)
    want = torch.log_softmax(logits / temp[:, None], -1).gather(1, tok[:, None]).squeeze(1)
    torch.testing.assert_close(lp[:5], want[:5], rtol=0, atol=1e-6)
    # the greedy row is the policy's own argmax, its logprob at T = 0.8 unperturbed
    assert tok[5] == logits[5].argmax() and lp[5] == plain_lp[5]


def _learner_kl(model, model_dir, perturbation: str, scale: float = 0.1) -> float:
    """Sampled rollouts of the engine under a perturbation, then the learner's forward on them: the
    mean k3 KL(μ ‖ π_old) over their tokens, as the learner's MismatchMeter reports it."""
    engine = BuiltinEngine(
        load_model(model_dir), max_running_requests=16, seed=3, perturbation=perturbation, perturbation_scale=scale
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(6, 80, size=6).tolist() for _ in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    out = engine.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)])
    engine.close()
    samples = []
    for i, p in enumerate(prompts):
        s = Sample(group_id="g", index=i, prompt_ids=p, max_new_tokens=24)
        s.append(out[str(i)].token_ids, np.asarray(out[str(i)].logprobs, dtype=np.float32), 0)
        samples.append(s)
    batch = collate(samples, [0] * len(samples), model.config.pad_token_id or 0)
    with torch.no_grad():
        old_logp = response_logprobs(model, batch, 1.0)[0]
    meter = MismatchMeter()
    meter.add(old_logp, batch.behaviour_logp, batch.mask, batch.versions, 0)
    return meter.metrics()["mismatch_fresh_kl"]


def test_the_learner_measures_a_clear_gap_under_either_perturbation(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir).eval()
    off = _learner_kl(model, tiny_model_dir, "none")
    bf16 = _learner_kl(model, tiny_model_dir, "bf16_logits")
    noisy = _learner_kl(model, tiny_model_dir, "temperature_noise", 0.1)
    print(f"KL(mu || pi_old) per token: off {off:.2e}, bf16_logits {bf16:.2e}, temperature_noise 0.1 {noisy:.2e}")
    assert off < 1e-8  # the same float32 weights: numerics only
    assert bf16 > 100 * off and bf16 > 1e-6
    assert noisy > 100 * off and noisy > 1e-4


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_other_engines_refuse_it_at_load_naming_the_field(engine: str) -> None:
    with pytest.raises(
        ConfigError, match=r"rollout\.behaviour_perturbation\.kind=bf16_logits needs rollout\.engine=builtin"
    ):
        load_config(None, [f"rollout.engine={engine}", "rollout.behaviour_perturbation.kind=bf16_logits"])
    load_config(None, [f"rollout.engine={engine}"])  # off: nothing to refuse


def test_an_unknown_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.behaviour_perturbation\.kind"):
        load_config(None, ["rollout.behaviour_perturbation.kind=fp8"])
    with pytest.raises(ValueError, match="perturbation must be one of"):
        BuiltinEngine(torch.nn.Linear(1, 1), perturbation="fp8")  # type: ignore[arg-type]
