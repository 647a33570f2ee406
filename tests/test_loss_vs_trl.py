"""The learner's GRPO-family step against TRL's: the same weights, batch, advantages and behaviour
logprobs go through our `Learner.update` (collate, packed forward, chunked log-probs, micro-batches,
the algorithm's loss, backward) and through TRL's own `GRPOTrainer._compute_loss` (its fused LM head,
a padded forward), and the loss and every parameter's gradient agree to float32 rounding.

TRL's method runs on a stand-in for the trainer that holds only the attributes it reads, so a TRL
release that reads others skips this test, naming the attribute (a numeric difference fails it).
Where the two define a quantity differently (docs/configuration.md, "Coming from THUDM slime":
the group std, the rows a per-sequence mean divides by), the batch keeps clear of it: groups with
different rewards, no fully masked row, and our own advantages handed to TRL.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slime.algorithms.batch import collate
from slime.config import load_config
from slime.learner import Learner
from slime.model import load_model
from slime.sample import Sample, Status

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

TEMPERATURE, CLIP_LOW, CLIP_HIGH, MAX_NEW, GROUP = 0.8, 0.2, 0.28, 10, 4
LENGTHS = [7, 3, 5, 1, 6, 10, 2, 4, 8, 2, 5, 3]
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.7, 0.1, 0.9, 0.4, 0.3, 0.9, 0.1, 0.6]


class _Accelerator:
    num_processes, sync_gradients, is_main_process = 1, True, True

    def autocast(self):
        return contextlib.nullcontext()

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


class _TrlTrainer:
    """What GRPOTrainer._compute_loss reads of its trainer, for one process and one update."""

    _compute_loss = trl_grpo.GRPOTrainer._compute_loss
    _get_per_token_logps_and_entropies = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies

    def __init__(self, model: torch.nn.Module, loss_type: str, beta: float) -> None:
        self.model, self.loss_type, self.beta = model, loss_type, beta
        self.epsilon_low, self.epsilon_high = CLIP_LOW, CLIP_HIGH
        self.max_completion_length = MAX_NEW
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.importance_sampling_level = "token"
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.current_gradient_accumulation_steps = 1
        self._entropy_bonus_enabled, self.entropy_coef, self.use_adaptive_entropy = False, 0.0, False
        self.aux_loss_enabled = False
        self.accelerator = _Accelerator()
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def _samples(behaviour: torch.Tensor | None) -> tuple[list[Sample], list[int]]:
    rng = np.random.default_rng(0)
    samples, groups = [], []
    for i, (length, reward) in enumerate(zip(LENGTHS, REWARDS)):
        s = Sample(f"g{i // GROUP}", i % GROUP, [10 + i // GROUP, 20, 30, 40, 50], MAX_NEW)
        logprobs = behaviour[i, :length].numpy() if behaviour is not None else np.zeros(length)
        s.append(rng.integers(3, 60, length), logprobs, 0, np.ones(length, np.int8))
        s.status, s.reward = Status.COMPLETED, reward
        samples.append(s)
        groups.append(i // GROUP)
    return samples, groups


def _trl_inputs(batch, advantages: torch.Tensor, ref_logp: torch.Tensor | None) -> dict:
    """TRL's inputs of a batch whose prompts all have one length (no left padding)."""
    rows, width = batch.response_ids.shape
    prompt = int((batch.last_pos + 1 - batch.response_len)[0])
    completion = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, n in enumerate(batch.response_len.tolist()):
        completion[i, :n] = batch.input_ids[i, prompt : prompt + n]
        mask[i, :n] = 1
    inputs = {
        "prompt_ids": batch.input_ids[:, :prompt],
        "prompt_mask": torch.ones_like(batch.input_ids[:, :prompt]),
        "completion_ids": completion,
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": batch.behaviour_logp,
        "num_items_in_batch": mask.sum(),
    }
    if ref_logp is not None:
        inputs["ref_per_token_logps"] = ref_logp
    return inputs


def _trl_model(model_dir: str, state: dict) -> torch.nn.Module:
    model = load_model(model_dir, "float32", "cpu")
    model.load_state_dict(state)
    model.train()
    trl_utils.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def _trl_logprobs(trainer: _TrlTrainer, model: torch.nn.Module, batch) -> torch.Tensor:
    inputs = _trl_inputs(batch, torch.zeros(len(batch.scores)), None)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, attention, inputs["completion_ids"].shape[1]
        )
    return logp


@pytest.mark.parametrize(
    ("algorithm", "loss_agg", "trl_loss_type", "beta"),
    [
        ("grpo", "token_mean", "bnpo", 0.04),  # and TRL's dapo: the same on one process
        ("grpo", "seq_mean_token_mean", "grpo", 0.0),
        ("dr_grpo", None, "dr_grpo", 0.04),
    ],
)
def test_the_learners_step_gives_trls_loss_and_gradient(
    tiny_model_dir, redis_url, tmp_path, algorithm, loss_agg, trl_loss_type, beta
):
    torch.manual_seed(0)
    overrides = [
        f"job_name=vs-trl-{algorithm}-{loss_agg}",
        f"output_dir={tmp_path}",
        f"algorithm.name={algorithm}",
        f"algorithm.clip_low={CLIP_LOW}",
        f"algorithm.clip_high={CLIP_HIGH}",
        "algorithm.router_aux_coef=0",
        f"algorithm.kl_coef={beta}",
        "algorithm.kl_estimator=k3",  # TRL's; our default is low_var_kl (k3 clamped at 10)
        f"rollout.temperature={TEMPERATURE}",
        f"rollout.max_new_tokens={MAX_NEW}",
        f"rollout.n_samples_per_prompt={GROUP}",
        "learner.grad_clip=1e9",  # the gradient stays as computed on .grad
        "learner.micro_batch_size=5",  # several micro-batches on our side, one batch on TRL's
        "cluster.torch_threads=1",
        *([f"algorithm.loss_agg={loss_agg}"] if loss_agg else []),
    ]
    learner = Learner(load_config(None, overrides), str(tiny_model_dir), redis_url)
    try:
        start = copy.deepcopy(learner.policy.state_dict())
        ref_state = None
        if learner.ref is not None:  # the reference apart from the policy, so the KL has a gradient
            with torch.no_grad():
                for p in learner.ref.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            ref_state = copy.deepcopy(learner.ref.state_dict())
        policy = _trl_model(str(tiny_model_dir), start)
        probe = _TrlTrainer(policy, trl_loss_type, beta)
        samples, groups = _samples(None)
        # Behaviour logprobs: the policy's own plus noise, so ratios are off 1 and some are clipped.
        current = _trl_logprobs(probe, policy, collate(samples, groups, 0))
        behaviour = (current + 0.3 * torch.randn_like(current)).clamp(max=-1e-4)
        samples, groups = _samples(behaviour)
        batch = collate(samples, groups, 0)

        ours = learner.update(samples, groups, 0)
        our_grads = {n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.grad is not None}
        with torch.no_grad():
            fixed = learner.algorithm.prepare(batch, kl_coef=beta, old_logp=None, ref_logp=None)
        advantages = fixed.advantages.sum(-1) / batch.mask.sum(-1)  # one number per row, as TRL takes them
        ref_logp = _trl_logprobs(probe, _trl_model(str(tiny_model_dir), ref_state), batch) if ref_state else None

        trainer = _TrlTrainer(policy, trl_loss_type, beta)
        try:
            theirs = trainer._compute_loss(policy, _trl_inputs(batch, advantages, ref_logp))
        except AttributeError as exc:
            pytest.skip(f"this TRL's GRPOTrainer._compute_loss reads more of its trainer: {exc}")
        theirs.backward()
        their_grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    finally:
        learner.close()

    assert set(our_grads) == set(their_grads)
    largest = max(g.abs().max().item() for g in their_grads.values())
    worst = max((our_grads[n] - g).abs().max().item() for n, g in their_grads.items())
    assert abs(ours["loss"] - theirs.item()) < 1e-6, (ours["loss"], theirs.item())
    assert worst < 1e-5 * max(1.0, largest), f"gradients differ by {worst:.2e} (largest {largest:.2e})"
    assert ours["clipfrac"] == pytest.approx(trainer._metrics["train"]["clip_ratio/region_mean"][-1], abs=1e-6)
    assert 0 < ours["clipfrac"] < 1  # the clip was exercised, not only the unclipped branch
