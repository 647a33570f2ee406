"""The training side's options (`algorithm.*`, `learner.*` in the job config): the algorithm and its
loss terms, each algorithm's own settings (`algorithm.gspo.*`, ...), the off-policy correction
(`algorithm.correction.*`), the optimizer, and the learner group's shape (ranks, precision, routing
replay). slime/config/job.py checks the rules across sections."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from slime.config.base import StrictModel as _Strict
from slime.config.base import check_device

log = logging.getLogger(__name__)

# Algorithms whose advantages come from per-token rewards with the KL penalty always in them.
KL_ALWAYS_IN_REWARD = ("reinforce_pp", "reinforce_pp_baseline")
# Keys that only some algorithms read (slime/algorithms/*.py): key -> the algorithms that read it.
UNUSED_UNLESS: dict[str, tuple[str, ...]] = {
    "lam": ("ppo",),
    "value_clip": ("ppo",),
    "vf_coef": ("ppo",),
    "normalize_advantages": ("ppo",),
    "gamma": ("ppo", *KL_ALWAYS_IN_REWARD),
    "grpo_std_normalize": ("grpo", "gspo", "cispo", "grpo_passk"),
    "dual_clip": ("ppo", "grpo", "gspo", "rloo", "dr_grpo", "opo", "grpo_passk", *KL_ALWAYS_IN_REWARD),
}


class StagedKL(_Strict):
    until_step: int = Field(..., ge=0)
    coef: float = Field(..., ge=0)


class AdaptiveClipConfig(_Strict):
    """GLM-5 report 4.7: shrink the clip range when measured KL overshoots the target, widen it below."""

    enabled: bool = False
    kl_target: float = Field(0.01, gt=0)
    shrink: float = Field(0.9, gt=0, lt=1)
    grow: float = Field(1.1, gt=1)
    min_clip: float = Field(0.05, gt=0)
    max_clip: float = Field(0.4, gt=0)


# The corrections whose band is algorithm.correction.tis_cap (the ones algorithm.correction.auto can tune).
TIS_CAP_CORRECTIONS = frozenset({"tis", "mis_token", "mis_seq", "decoupled", "behaviour_clip"})


class AutoOffPolicyConfig(_Strict):
    """The automatic off-policy controller (slime/algorithms/offpolicy_controller.py, docs/offpolicy.md):
    each step it reads the mismatch the learner measured and sets, for the next step, the staleness
    budget and the correction's cap, moving toward target_kl within these bounds."""

    enabled: bool = Field(False, description="Tune the staleness budget and tis_cap from the measured mismatch.")
    target_kl: float = Field(
        0.02,
        gt=0,
        description="The mean KL(mu || pi_old) per trained token (k3, all kinds) beyond the engine-learner gap "
        "(the fresh tokens' KL) that it steers to: tighter above it, looser below loosen_below x it. 0.02 lies "
        "between what behaviour_clip held at lr 5e-4 and 1e-3 on the study's tiny MoE (0.008-0.044) and well "
        "under where tis collapsed (0.1-0.37).",
    )
    loosen_below: float = Field(
        0.5, gt=0, lt=1, description="Loosen only when the smoothed KL is below this share of target_kl."
    )
    smoothing: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="Weight of the past in the KL it acts on (an exponential mean over steps; 0: this step's only).",
    )
    max_clipped_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="No loosening while offpolicy_clipped_share is above this (a heavy tail under a small mean).",
    )
    min_held_share: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Raise the staleness budget only when it held the rollout back by more than this since the "
        "last step (async: the share of the time the learner waited for its batch while admission was capped "
        "below the in-flight target; APRIL: the share of generated tokens thrown away because their partial was "
        "beyond max_version_span). A looser budget buys speed only where the rollout waited on it.",
    )
    min_staleness: int = Field(
        1, ge=0, description="Floor of the staleness budget it sets (async: max_staleness; APRIL: max_version_span)."
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="Hard cap of the staleness budget it sets. Async: the learner drops groups beyond this cap "
        "(admission follows the controller), so a group admitted before a tightening is still trained.",
    )
    min_tis_cap: float = Field(1.25, gt=1, description="Floor of the tis_cap it sets.")
    max_tis_cap: float = Field(4.0, gt=1, description="Hard cap of the tis_cap it sets.")
    tis_cap_step: float = Field(1.25, gt=1, description="tis_cap moves by at most this factor per step.")
    gap_probe_every: int = Field(
        10,
        ge=0,
        description="After this many steps in a row without a fresh trained token (async after its first step), "
        "the engines sample gap_probe_samples responses right after the weight push and the learner scores them "
        "at the same version: the engine-learner gap measured again, so a gap that drifts is followed. 0: never.",
    )
    gap_probe_samples: int = Field(
        16, ge=1, description="Responses per gap probe: the dataset's prompts in turn, the rollout's sampling."
    )

    @model_validator(mode="after")
    def _check(self) -> AutoOffPolicyConfig:
        if self.min_staleness > self.max_staleness:
            raise ValueError(
                f"algorithm.correction.auto.min_staleness={self.min_staleness} exceeds max_staleness={self.max_staleness}"
            )
        if self.min_tis_cap > self.max_tis_cap:
            raise ValueError(
                f"algorithm.correction.auto.min_tis_cap={self.min_tis_cap} exceeds max_tis_cap={self.max_tis_cap}"
            )
        return self


class CorrectionConfig(_Strict):
    """The off-policy correction the loss applies (slime/algorithms/corrections/, docs/offpolicy.md)."""

    name: Literal[
        "none",
        "mask_stale",
        "tis",
        "mis_token",
        "mis_seq",
        "decoupled",
        "icepop",
        "geo_reject",
        "m2po",
        "opsm",
        "behaviour_clip",
    ] = Field(
        "behaviour_clip",
        description="Correction for tokens an older or different policy sampled (APRIL partials, async "
        "staleness, train-inference mismatch); one file each in slime/algorithms/corrections/. The default "
        "takes the PPO ratio and clip against the sampler (docs/offpolicy.md: tis collapsed async and APRIL "
        "at lr 1e-3 where it holds).",
    )
    clip_band_per_version: bool = Field(
        True,
        description="behaviour_clip: a token sampled k versions before the learner's gets the clip band "
        "compounded k + 1 times, one PPO step per version, within [1/tis_cap, tis_cap] (False: the same band "
        "for every token).",
    )
    tis_cap: float = Field(
        2.0,
        gt=0,
        description="c: tis truncates at c, mis_* mask outside [1/c, c], decoupled masks above c, "
        "behaviour_clip's band widens to [1/c, c] at most.",
    )
    icepop_band: tuple[float, float] = Field((0.5, 5.0), description="IcePop [alpha, beta] for pi_old/mu.")
    geo_band: tuple[float, float] = Field(
        (0.8, 1.25), description="geo_reject: keep a sequence whose geometric-mean ratio is inside."
    )
    m2po_threshold: float = Field(0.04, gt=0, description="M2PO: the batch mean of (log ratio)^2 after masking.")
    opsm_delta: float = Field(
        0.1, ge=0, description="OPSM: drop negative-advantage sequences with KL(mu||pi_old) above this."
    )
    auto: AutoOffPolicyConfig = Field(
        AutoOffPolicyConfig(),
        description="The controller that sets the staleness budget and tis_cap each step from the measured "
        "mismatch (off by default).",
    )

    @field_validator("icepop_band", "geo_band")
    @classmethod
    def _band_brackets_one(cls, band: tuple[float, float]) -> tuple[float, float]:
        # The corrections refuse anything else when the learner is built (a raw traceback then).
        low, high = band
        if not 0 < low <= 1 <= high:
            raise ValueError(f"[{low}, {high}] must satisfy 0 < low <= 1 <= high")
        return band


class GspoConfig(_Strict):
    """GSPO's clip on the sequence ratio (slime/algorithms/gspo.py)."""

    clip_low: float = Field(3e-4, gt=0, lt=1, description="epsilon_low on the sequence ratio.")
    clip_high: float = Field(4e-4, gt=0, description="epsilon_high on the sequence ratio.")


class CispoConfig(_Strict):
    """CISPO's cap on the importance weight (slime/algorithms/cispo.py)."""

    clip_high: float = Field(0.28, gt=0, description="The IS weight is capped at 1 + this.")


class DrGrpoConfig(_Strict):
    """Dr. GRPO's constant divisor (slime/algorithms/dr_grpo.py)."""

    norm_tokens: int | None = Field(None, gt=0, description="The divisor C; None: each row's max_new_tokens.")


class AlgorithmConfig(_Strict):
    name: Literal[
        "ppo", "grpo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "opo", "grpo_passk"
    ] = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip c for negative advantages; None disables.")
    value_clip: float | None = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl",
        description="KL(pi || pi_ref) per token. Default: low_var_kl for a KL in the loss, k1 for a KL in the reward "
        "(kl_mode=reward, REINFORCE++), where only k1's score-function gradient is the KL's own.",
    )
    kl_mode: Literal["loss", "reward"] = "loss"
    kl_schedule: list[StagedKL] = Field(default_factory=list, description="Staged KL coefficient; overrides kl_coef.")
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL coefficient (Ziegler et al. 2019; verl's kl_ctrl.type=adaptive, OpenRLHF's "
        "--kl_target): starting from kl_coef, after each step beta *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) x "
        "samples / kl_horizon, KL being the step's mean per-token KL to the reference. None: beta as set.",
    )
    kl_horizon: int = Field(10_000, gt=0, description="The adaptive KL coefficient's horizon, in samples.")
    adaptive_clip: AdaptiveClipConfig = AdaptiveClipConfig()
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    normalize_advantages: bool = True
    grpo_std_normalize: bool = True
    router_aux_coef: float = Field(0.001, ge=0, description="MoE router load-balancing loss weight.")
    correction: CorrectionConfig = CorrectionConfig()
    gspo: GspoConfig = GspoConfig()
    cispo: CispoConfig = CispoConfig()
    dr_grpo: DrGrpoConfig = DrGrpoConfig()
    overlong_buffer: int | None = Field(None, gt=0, description="DAPO overlong shaping: L_cache; None = off.")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong shaping: the penalty at L_max.")

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        defaults = type(self).model_fields
        # Set and not the default (a run's own config.yaml writes the defaults out: no warning then).
        token_clips = sorted(
            k for k in {"clip_low", "clip_high"} & self.model_fields_set if getattr(self, k) != defaults[k].default
        )
        if self.name in ("gspo", "cispo") and token_clips:  # slime's --eps-clip does reach GSPO
            own = f"algorithm.{self.name}.clip_high" + (" and clip_low" if self.name == "gspo" else "")
            log.warning(
                "algorithm.name=%s ignores algorithm.%s (the token-ratio clip of the other algorithms); its clip is %s",
                self.name,
                " and algorithm.".join(token_clips),
                own,
            )
        if self.name in ("gspo", "dr_grpo") and self.loss_agg == "token_mean":  # learner weighs by sequences
            if "loss_agg" in self.model_fields_set:
                default = "seq_mean_token_sum" if self.name == "dr_grpo" else "seq_mean_token_mean"
                other = "seq_mean_token_mean" if self.name == "dr_grpo" else "seq_mean_token_sum"
                raise ValueError(
                    f"algorithm.name={self.name} averages over sequences: loss_agg=token_mean is refused; set "
                    f"algorithm.loss_agg={default} (its default when unset) or algorithm.loss_agg={other}"
                )
            self.loss_agg = "seq_mean_token_sum" if self.name == "dr_grpo" else "seq_mean_token_mean"
        # A KL in the REWARD (PPO's kl_mode=reward; REINFORCE++ always) reaches the policy through the
        # score function, E[grad log pi * k]: that is grad KL(pi||pi_ref) only for k1. With k3 it is
        # grad KL(pi||ref) - grad KL(ref||pi): ~0 near pi_ref, and it may point away from it.
        # verl's in-reward default and OpenRLHF's are k1, as is REINFORCE++'s definition.
        if self.name in KL_ALWAYS_IN_REWARD and self.kl_mode == "loss":
            if "kl_mode" in self.model_fields_set and (self.kl_coef > 0 or self.kl_schedule):
                log.warning(
                    "algorithm.name=%s puts the KL in the reward (REINFORCE++'s definition): algorithm.kl_mode=loss "
                    "is not used; for a KL in the loss take grpo, rloo or dr_grpo",
                    self.name,
                )
            self.kl_mode = "reward"  # what it does; the run's config.yaml says so
        self._warn_unused_keys()
        kl_in_reward = self.kl_mode == "reward" or self.name in KL_ALWAYS_IN_REWARD
        if kl_in_reward and "kl_estimator" not in self.model_fields_set:
            self.kl_estimator = "k1"
        wants_kl = self.kl_coef > 0 or any(s.coef > 0 for s in self.kl_schedule)
        if self.kl_mode == "reward" and wants_kl and self.name not in {"ppo", *KL_ALWAYS_IN_REWARD}:
            raise ValueError(
                f"algorithm.kl_mode=reward: {self.name} has no per-token reward for a KL to shape (its "
                "advantage is one number per sequence), so the KL would be dropped; use kl_mode=loss"
            )
        steps = [s.until_step for s in self.kl_schedule]
        if steps != sorted(steps):
            raise ValueError("algorithm.kl_schedule: until_step values must increase")
        if self.adaptive_clip.min_clip > self.adaptive_clip.max_clip:
            raise ValueError("algorithm.adaptive_clip.min_clip must not exceed max_clip")
        if self.kl_target is not None and (self.kl_schedule or self.kl_coef <= 0):
            raise ValueError(
                "algorithm.kl_target adapts beta from algorithm.kl_coef: set kl_coef > 0 (the starting beta) "
                "and no kl_schedule"
            )
        return self

    def _warn_unused_keys(self) -> None:
        """A key set to a value of its own that this algorithm never reads (a verl habit: a critic's
        keys on GRPO), named in one warning instead of being dropped silently."""
        defaults = type(self).model_fields
        unused = [
            f"{key}={getattr(self, key)}"
            for key, readers in UNUSED_UNLESS.items()
            if self.name not in readers and key in self.model_fields_set and getattr(self, key) != defaults[key].default
        ]
        if unused:
            log.warning(
                "algorithm.name=%s does not use algorithm.%s: ignored (docs/learner.md says which algorithm reads what)",
                self.name,
                ", algorithm.".join(unused),
            )


class LoraSettings(_Strict):
    """LoRA on the policy (slime/learner/lora.py, docs/learner.md "LoRA"): the base weights stay frozen,
    only the adapters train, and each weight push carries only the adapters."""

    rank: int = Field(8, gt=0, description="r: the adapters' inner size (A is [r, in], B is [out, r]).")
    alpha: float = Field(16.0, gt=0, description="The adapters' output is scaled by alpha / rank (no rsLoRA).")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input while training (above 0 the training forwards, pi_old "
        "included, are random; the reference, the probe and the engines never drop).",
    )
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="peft's semantics: a list entry adapts every nn.Linear whose module name ends with it "
        "('q_proj' or 'self_attn.q_proj'); one string is a regex matched against whole module names. An entry "
        "that matches nothing, or matches a module that is not an nn.Linear (an MoE router, fused experts), "
        "fails when the learner is built. LoRA on MoE experts is not supported.",
    )
    layers: list[int] | None = Field(
        None,
        description="Only these decoder layers (peft's layers_to_transform; with a list of target_modules); "
        "None: every layer.",
    )

    @model_validator(mode="after")
    def _check(self) -> LoraSettings:
        targets = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        if not targets or any(not t.strip() for t in targets):
            raise ValueError("learner.lora.target_modules: give at least one module name (no empty entries)")
        if self.layers is not None:
            if isinstance(self.target_modules, str):
                raise ValueError(
                    "learner.lora.layers works with a list of target_modules; with a regex, put the layer "
                    "numbers into the regex"
                )
            if not self.layers or any(i < 0 for i in self.layers):
                raise ValueError(f"learner.lora.layers={self.layers}: layer numbers from 0 (None: every layer)")
        return self


class LearnerConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    critic_lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0)
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="lr and critic_lr rise linearly over the first N steps: step s uses (s+1)/N of them (verl's "
        "lr_warmup_steps; OpenRLHF's lr_warmup_ratio x steps).",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After the warmup: constant, or decay (linear, cosine) to min_lr_ratio x lr at the last step.",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Where lr_schedule=linear|cosine ends, as a share of lr.")
    critic_warmup_steps: int = Field(
        0,
        ge=0,
        description="PPO: the first N steps train only the critic; the policy is not stepped (verl's "
        "trainer.critic_warmup, OpenRLHF's freezing_actor_steps).",
    )
    ppo_epochs: int = Field(1, gt=0)
    num_minibatches: int = Field(1, gt=0)
    micro_batch_size: int = Field(
        32, gt=0, le=1_000_000, description="Sequences per forward/backward; gradients accumulate."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Cut micro-batches by tokens instead of sequences (slime's --max-tokens-per-gpu, verl's "
        "dynamic batch size): rows of similar lengths together up to this many tokens (packed: real tokens; "
        "padded: rows x the longest row); a longer row goes alone. micro_batch_size is then unused.",
    )
    packing: bool = Field(
        True,
        description="Padding-free micro-batches: the rows run as one sequence, attention kept inside each row "
        "(slime/learner/packing.py). Checked at start against the model's own forward; a model that fails keeps "
        "padded rows, the reason logged.",
    )
    logit_chunk_tokens: int = Field(
        2048,
        ge=0,
        description="Log-probs and entropy from the output head's input, this many response positions at a "
        "time, each chunk's logits recomputed in backward: no [T, vocab] logits at any length "
        "(slime/learner/forwards.py). Checked at start against the model's own logits; a model that fails keeps "
        "whole logits, the reason logged. 0: whole logits.",
    )
    recompute_old_logprobs: bool = Field(
        False,
        description="Recompute pi_old with the learner before the update; otherwise the first forward's "
        "detached logprobs are pi_old (identical when ppo_epochs=num_minibatches=1).",
    )
    device: Annotated[str, AfterValidator(check_device)] = "cpu"
    num_ranks: int = Field(
        1,
        ge=1,
        description="Learner processes forming one torch.distributed group (gloo on CPU, NCCL on CUDA). "
        "Above 1, FSDP2 shards the policy, the critic and their optimizer state over them.",
    )
    mixed_precision: bool = Field(
        False,
        description="bf16 compute over fp32 master weights, fp32 gradient reduction and optimizer state "
        "(FSDP2's MixedPrecisionPolicy; the model loads in float32). For GPUs.",
    )
    activation_checkpointing: bool = Field(False, description="Recompute each layer's activations in backward.")
    lora: LoraSettings | None = Field(
        None,
        description="LoRA RL (docs/learner.md, section LoRA): a frozen base plus trained adapters; the KL reference "
        "is the base (the adapters off), pushes and checkpoints hold only the adapters. None: full fine-tuning.",
    )
    routing_replay: bool = Field(
        False,
        description="MoE routing replay (R3): the built-in engine records each token's experts, and the learner's "
        "policy forwards route those tokens through them (slime/engines/routing.py).",
    )
    cpus_per_rank: float = Field(
        0.0, ge=0, description="Ray CPUs each learner rank reserves (0 keeps a 2-core box schedulable)."
    )
    resources_per_rank: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each learner rank needs, e.g. {learner_node: 1} to place the ranks.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # AdamW refuses anything else when the learner is built (a raw traceback then).
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"{list(betas)}: AdamW's betas must each lie in [0, 1)")
        return betas
