"""The job configuration: pydantic models, YAML files, `a.b=value` command-line overrides.

Every model forbids unknown keys, so a typo fails at load with the field's dotted path.
Cross-field rules live in `model_validator`s and name the fields they compare.

Secrets (a dashboard token, a judge's `api_key`, a reward server's token) can be written as an
environment reference, a whole value `${NAME}`: it is resolved at load, and the config the job
writes (`config.yaml`, 0600) keeps the reference, never the value. Literal secrets are written
as `***`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from slime.config_engines import RolloutConfig, SglangConfig, VllmConfig
from slime.config_engines import StrictModel as _Strict
from slime.config_training import AlgorithmConfig, LearnerConfig
from slime.errors import UserError
from slime.security import redact, write_private

ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the field and the reason."""

    hint = "`slime config [CONFIG.yaml] [key=value ...]` prints every field with the value it would take"


class TinyModelConfig(_Strict):
    """The built-in default policy: a Qwen3-MoE built in code with a character-level tokenizer."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    num_experts: int = Field(8, gt=0)
    experts_per_token: int = Field(2, gt=0)
    expert_hidden_size: int = Field(128, gt=0)
    max_position_embeddings: int = Field(512, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be divisible by model.tiny.num_kv_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError("model.tiny.experts_per_token cannot exceed model.tiny.num_experts")
        return self


class WarmstartConfig(_Strict):
    """Short supervised pass on generated demonstrations of the example task (cached on disk)."""

    enabled: bool = True
    steps: int = Field(100, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)
    num_examples: int = Field(4000, gt=0)


class ModelConfig(_Strict):
    path: str | None = Field(
        None, description="Local Hugging Face causal LM directory (with tokenizer); None builds the tiny MoE."
    )
    tiny: TinyModelConfig = TinyModelConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    cache_dir: str = Field("~/.cache/slime-april", description="Where the built tiny model is cached.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0


class DataConfig(_Strict):
    path: str | None = Field(
        None, description="JSONL, Parquet or a local HF dataset directory; None generates the example task."
    )
    prompt_key: str = "prompt"
    label_key: str = "label"
    task_key: str = "task"
    apply_chat_template: bool = False
    max_prompt_tokens: int = Field(256, gt=0)
    shuffle: bool = True
    seed: int = 0
    num_generated: int = Field(2000, gt=0, description="Prompts generated for the example task when path is None.")


class AprilConfig(_Strict):
    """Active Partial Rollouts: over-provision, abort the long tail at the batch boundary, resume later."""

    enabled: bool = False
    oversample: float = Field(2.0, ge=1.0, description="Keep ceil(oversample * batch_size) groups in flight.")
    oversample_groups: int | None = Field(
        None, gt=0, description="Absolute number of groups in flight; overrides oversample."
    )
    off_policy: Literal[
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
    max_version_span: int | None = Field(
        None, ge=0, description="Staleness budget: most versions a partial's oldest token may lag the policy."
    )
    beyond_budget: Literal["restart", "drop"] = Field(
        "restart", description="A partial over the budget: regenerate it from scratch, or fail it (counted)."
    )
    filter_zero_variance: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal."
    )
    max_filtered_per_step: int | None = Field(
        None, ge=0, description="Fallback: after this many drops in a step, keep groups (default: batch_size)."
    )
    streaming_chunk_tokens: int | None = Field(
        None,
        gt=0,
        description="GLM-5 streaming variant (PPO): train on each trajectory every N new tokens before it "
        "finishes, bootstrapping unfinished returns with the critic; None = abort-and-resume.",
    )
    chunk_sampler: str | None = Field(
        None, description="Active sampler hook `module:function(state) -> temperature | None`, called per chunk."
    )


class TaskWeighting(_Strict):
    """GLM-5 report 4.7: weights rise (x grow) for tasks scoring below their target, then renormalise."""

    weights: dict[str, float] = Field(default_factory=dict)
    targets: dict[str, float] = Field(default_factory=dict)
    grow: float = Field(1.1, gt=1)


class CurriculumStage(_Strict):
    name: str
    filter: dict[str, Any] = Field(default_factory=dict, description="Metadata equalities a prompt must match.")
    advance_at_reward: float | None = Field(None, description="Mean reward (recent window) that ends the stage.")


class SamplingConfig(_Strict):
    tasks: TaskWeighting | None = None
    curriculum: list[CurriculumStage] = Field(default_factory=list)
    window: int = Field(4, gt=0, description="Steps of reward history used by task weights and curriculum.")


class RewardConfig(_Strict):
    fn: str | dict[str, Any] = Field(
        "envs.repeat:reward",
        description="`package.module:function` or `path/to/file.py:function`, or a mix/route spec "
        "({mix: [{fn, weight}, ...]} or {route: field, routes: {value: spec}, default: spec}).",
    )
    timeout_s: float = Field(30.0, gt=0, description="Per-sample limit; a slower call fails that sample.")
    max_concurrency: int = Field(8, gt=0, description="Calls at once (remote modes: batches in flight).")
    mode: Literal["in_process", "ray_actor", "http"] = Field(
        "in_process",
        description="Where the reward runs: in each rollout worker, in one Ray actor per job (num_cpus=0), "
        "or behind HTTP (`slime reward-serve SPEC --port N`; set url). rewards/service.py.",
    )
    url: str | None = Field(None, description="mode=http: the reward server, e.g. http://127.0.0.1:8000.")
    batch_size: int = Field(32, gt=0, description="Remote modes: most samples per call.")
    request_timeout_s: float | None = Field(
        None, gt=0, description="Remote modes: limit per call attempt (default 2*timeout_s + 5)."
    )
    max_retries: int = Field(3, ge=0, description="Remote modes: retries after a failed call.")
    backoff_s: float = Field(0.5, ge=0, description="Remote modes: first retry delay; doubles each retry.")
    cache_size: int = Field(
        4096, ge=0, description="Successful results kept, keyed by prompt+response+label (0: no cache)."
    )
    max_failed_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The job stops (exit 1, no checkpoint of those steps) when more than this share of the "
        "samples of the last failed_window_steps steps failed, naming the commonest reasons (1: never).",
    )
    failed_window_steps: int = Field(3, gt=0, description="Steps over which max_failed_share is measured.")
    token: str | None = Field(
        None,
        description="mode=http: the reward server's token (sent as `Authorization: Bearer`); write it as "
        "an environment reference such as ${SLIME_REWARD_TOKEN} to keep it out of files.",
    )

    @model_validator(mode="after")
    def _mode_needs_url(self) -> RewardConfig:
        if self.mode == "http" and not self.url:
            raise ValueError("reward.url is required when reward.mode is 'http' (start one with `slime reward-serve`)")
        if self.url and self.mode != "http":
            raise ValueError(f"reward.url is set but reward.mode is {self.mode!r}; set reward.mode=http to use it")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url must start with http:// or https://, got {self.url!r}")
        return self


class EnvConfig(_Strict):
    """Multi-turn environment (slime/rollout/multiturn.py): model turns and env turns alternate in one trajectory."""

    plugin: str | None = Field(
        None, description="Env class `package.module:Class` or `path/to/file.py:Class`; None = single-turn."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env class.")
    reward: Literal["env", "reward_fn"] = Field(
        "env", description="Final reward: the sum of the env's step rewards, or reward.fn on the whole transcript."
    )
    max_turns: int = Field(4, gt=0, description="Model turns per episode.")
    max_turn_tokens: int = Field(
        64, gt=0, description="Tokens per model turn (rollout.max_new_tokens caps the episode)."
    )
    max_observation_tokens: int = Field(128, gt=0, description="Longer observations are cut to this many tokens.")
    max_turn_seconds: float | None = Field(
        None, gt=0, description="A model turn running longer ends the episode (truncated)."
    )
    max_episode_seconds: float | None = Field(
        None, gt=0, description="Episode wall clock on one worker (truncated past it)."
    )
    step_timeout_s: float = Field(30.0, gt=0, description="An env step (or reset) running longer fails the sample.")
    max_concurrency: int = Field(4, gt=0, description="Env steps running at once per worker (thread pool).")

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if self.plugin is not None and ":" not in self.plugin:
            raise ValueError(f"env.plugin {self.plugin!r} must be `package.module:Class` or `path/to/file.py:Class`")
        return self


class BufferConfig(_Strict):
    url: str | None = Field(
        None,
        description="redis://host:port/db, or a Redis Cluster's redis+cluster://host:port (any node); "
        "None starts a local redis-server.",
    )
    aof: bool = True
    appendfsync: Literal["always", "everysec"] = Field(
        "everysec",
        description="The local redis-server's AOF fsync. always: nothing acknowledged is lost, at one fsync "
        "per write. everysec: a crash of the machine loses up to the last second or two, and so can a "
        "killed redis-server under disk load (Redis then replies before it writes the AOF while an "
        "earlier fsync runs); the lost tail is detected and resumed from what was stored.",
    )
    lease_seconds: float = Field(10.0, gt=0)
    keep_trained_steps: int | None = Field(
        50,
        ge=0,
        description="Trajectories of groups trained this many steps before the last checkpoint are deleted from "
        "Redis when a checkpoint is written, and so are those of groups the filter dropped before the checkpoint "
        "of that step (their group records and group counts stay; stats count pruned_groups, pruned_samples, "
        "pruned_tokens), so a long job's buffer stays bounded. None keeps every trajectory. Streaming mode "
        "(april.streaming_chunk_tokens) keeps them all.",
    )
    reconnect_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long every part retries (with backoff) a Redis that went away before it "
        "gives up: long enough for a restart that replays the AOF.",
    )
    replica_acks: int = Field(
        0,
        ge=0,
        description="Replicas that must confirm each buffer write (WAIT) before it counts as stored: with 1, "
        "a master killed after acknowledging loses nothing once its replica is promoted (Redis Cluster or a "
        "replicated server). 0: acknowledged when the master has it.",
    )


class WeightsConfig(_Strict):
    transport: Literal["auto", "shm", "cuda_ipc", "file", "broadcast"] = Field(
        "auto",
        description="auto: cuda_ipc when the learner is on CUDA, else shared memory; broadcast: a "
        "torch.distributed group (NCCL on GPU, gloo on CPU) across processes and machines.",
    )
    bucket_mb: float = Field(64.0, gt=0)
    check_every: int = Field(
        1, ge=0, description="Compare engine and learner logprobs on a probe after every Nth update (0: never)."
    )
    check_tolerance: float = Field(
        1e-3,
        gt=0,
        description="Largest probe logprob difference allowed. With learner.mixed_precision the learner's probe "
        "runs in bf16 against the engine's own precision: at least 5e-2 then (JobConfig.weight_check_tolerance).",
    )


class ClusterConfig(_Strict):
    ray_address: str | None = Field(
        None,
        description="None: the job starts a Ray of its own; auto: join the cluster this machine belongs to "
        "(what a submitted job does, slime submit); HOST:PORT: that cluster's GCS address.",
    )
    num_cpus: int | None = Field(None, gt=0)
    torch_threads: int = Field(1, gt=0, description="torch threads per actor (2-core boxes: keep 1).")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: learner ranks and rollout engines share the devices (GPUs needed: the larger "
        "of the two counts; in sync mode GPU engines free their KV memory while the learner trains, see "
        "rollout.release_memory). disaggregated: separate devices, each rank and each GPU engine reserves one.",
    )


class LoggingConfig(_Strict):
    jsonl: bool = True
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True


class DashboardConfig(_Strict):
    """The buffer API and live page beside the job (slime/dashboard, docs/dashboard.md)."""

    enabled: bool = False
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback needs a token.")
    port: int = Field(8377, ge=0, lt=65536, description="0: a free port.")
    token: str | None = Field(
        None,
        min_length=8,
        description="Control routes always need it, every route off loopback (header "
        "Authorization: Bearer); default: derived from the job secret and written to run_dir/dashboard.token.",
    )

    @model_validator(mode="after")
    def _remote_needs_token(self) -> DashboardConfig:
        if self.host not in ("127.0.0.1", "::1", "localhost") and not self.token:
            raise ValueError(f"dashboard.host={self.host!r} is reachable by others: set dashboard.token")
        return self


class JobConfig(_Strict):
    job_name: str = Field("slime", pattern=r"^[A-Za-z0-9_.-]+$")
    output_dir: str = "outputs/slime"
    mode: Literal["sync", "async"] = "sync"
    steps: int = Field(30, gt=0)
    max_staleness: int = Field(1, ge=0, description="Async: most policy versions a trained token may lag.")
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0, description="Save every N steps (0: not by steps).")
    checkpoint_every_seconds: float = Field(
        300.0, ge=0, description="Save when this long has passed since the last save (0: not by time); and at the end."
    )
    resume: str | None = Field(None, description="A checkpoint directory, or 'auto' for the latest in output_dir.")
    max_restarts: int = Field(
        3, ge=0, description="Times the job restarts itself from its last checkpoint when a Ray actor dies (0: never)."
    )
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

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        # Their baseline is the other responses to the same prompt: a group of one has none.
        group_baseline = ("grpo", "gspo", "cispo", "rloo", "dr_grpo", "reinforce_pp_baseline")
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
        if (
            self.april.enabled
            and self.april.oversample_groups is not None
            and (self.april.oversample_groups < self.rollout.batch_size)
        ):
            raise ValueError(
                f"april.oversample_groups={self.april.oversample_groups} is below rollout.batch_size="
                f"{self.rollout.batch_size}: the batch could never fill"
            )
        if self.april.streaming_chunk_tokens is not None:
            if self.algorithm.name != "ppo":
                raise ValueError(
                    "april.streaming_chunk_tokens needs algorithm.name=ppo: unfinished trajectories are "
                    "bootstrapped with the critic's value (GRPO has no critic and needs final rewards)"
                )
            if self.mode != "sync":
                raise ValueError("april.streaming_chunk_tokens runs its own loop: leave mode=sync")
        if self.sampling.tasks is not None and self.data.task_key == "":
            raise ValueError("data.task_key must be set when sampling.tasks is configured")
        if self.buffer.replica_acks and self.buffer.url is None:
            raise ValueError(
                f"buffer.replica_acks={self.buffer.replica_acks} needs a replicated Redis at buffer.url: the job's "
                "own redis-server (buffer.url unset) has no replica, so no write could ever be acknowledged"
            )
        self._check_elastic()
        return self

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
    def weight_check_tolerance(self) -> float:
        """weights.check_tolerance; at least 5e-2 when the learner's forward is bf16 (mixed precision):
        a probe in bf16 differs from the same weights in fp32 by about 2e-2 (2.0e-2 measured on CPU, tiny MoE)."""
        tol = self.weights.check_tolerance
        return max(tol, 5e-2) if self.learner.mixed_precision else tol

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
    """One line per problem, each naming the field's dotted path."""
    lines = []
    for e in err.errors():
        path = prefix + (".".join(str(p) for p in e["loc"]) or "(top level)")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        lines.append(f"{path}: {msg}")
    if len(lines) == 1:
        return f"{title}: {lines[0]}"
    return f"{title}:\n" + "\n".join(f"  {line}" for line in lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`learner.lr=1e-5` -> (['learner', 'lr'], 1e-05). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    # YAML reads 1e-5 as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
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
