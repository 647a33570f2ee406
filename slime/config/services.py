"""The services around the loop: rewards (`reward.*`), multi-turn environments (`env.*`), the
trajectory buffer (`buffer.*`), weight transport (`weights.*`), placement (`cluster.*`), logging
and the dashboard."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from slime.config.base import StrictModel as _Strict


class RewardConfig(_Strict):
    fn: str | dict[str, Any] = Field(
        "envs.repeat:reward",
        description="`package.module:function` or `path/to/file.py:function`, or a mix/route spec "
        "({mix: [{fn, weight}, ...]} or {route: field, routes: {value: spec}, default: spec}).",
    )
    scope: Literal["sample", "group"] = Field(
        "sample",
        description="sample: reward.fn scores each response in the rollout workers. group: reward.fn scores "
        "each complete group's responses together (slime's --group-rm; rank, pairwise-judge, diversity rewards), "
        "once per group as the learner takes it (rewards/group.py).",
    )
    timeout_s: float = Field(
        30.0, gt=0, le=86400, description="Per-sample (scope=group: per-group) limit; a slower call fails."
    )
    max_concurrency: int = Field(8, gt=0, description="Calls at once (remote modes: batches in flight).")
    mode: Literal["in_process", "ray_actor", "http"] = Field(
        "in_process",
        description="Where the reward runs: in each rollout worker, in one Ray actor per job (num_cpus=0), "
        "or behind HTTP (`slime reward-serve SPEC --port N`; set url). rewards/service.py.",
    )
    url: str | None = Field(None, description="mode=http: the reward server, e.g. http://127.0.0.1:8000.")
    http_format: Literal["slime", "openrlhf"] = Field(
        "slime",
        description="mode=http: what the server speaks. slime: `slime reward-serve` (POST {url}/score). "
        "openrlhf: an OpenRLHF remote reward model (`--remote_rm_url`, e.g. `openrlhf.cli.serve_rm`): "
        'POST url itself {"query", "prompts", "labels"}, reply {"rewards": [...]}.',
    )
    batch_size: int = Field(32, gt=0, description="Remote modes: most samples per call.")
    request_timeout_s: float | None = Field(
        None, gt=0, description="Remote modes: limit per call attempt (default 2*timeout_s + 5)."
    )
    max_retries: int = Field(3, ge=0, description="Remote modes: retries after a failed call.")
    backoff_s: float = Field(0.5, ge=0, description="Remote modes: first retry delay; doubles each retry.")
    cache_size: int = Field(
        4096, ge=0, description="Successful results kept, keyed by prompt+response+label+metadata (0: no cache)."
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
        if self.http_format != "slime" and self.mode != "http":
            raise ValueError(f"reward.http_format={self.http_format} applies to reward.mode=http, not {self.mode!r}")
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
    turn_rewards: bool = Field(
        False,
        description="env.reward=env: each step's reward on the last token of the model turn it answers (token-level "
        "rewards: PPO/GAE and REINFORCE++ credit each turn) instead of their sum at the end; the sample's reward "
        "(GRPO, metrics) stays the sum.",
    )
    max_turns: int = Field(4, gt=0, description="Model turns per episode.")
    max_turn_tokens: int = Field(
        64, gt=0, description="Tokens per model turn (rollout.max_new_tokens caps the episode)."
    )
    max_observation_tokens: int = Field(
        128,
        gt=0,
        description="Longer observations keep their head and tail, with a marker between, in this many tokens.",
    )
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        description="The context budget: prompt, model turns and observations together; an episode that "
        "reaches it ends truncated (reason max_episode_tokens). None: rollout.max_new_tokens alone caps it.",
    )
    truncated_episodes: Literal["train", "mask"] = Field(
        "train",
        description="A truncated episode (a turn, token or time limit) still trains on its tokens (train), "
        "or keeps its reward for its group's baseline but none of its tokens in the loss (mask).",
    )
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
        "of that step (their group records, less the row's metadata, stay until keep_group_records_steps; stats "
        "count pruned_groups, pruned_samples, pruned_tokens), so a long job's buffer stays small. None keeps every trajectory. Streaming mode "
        "(april.streaming_chunk_tokens) prunes a streamed group by the step that trained its last segment.",
    )
    keep_group_records_steps: int | None = Field(
        1000,
        ge=0,
        description="The records of pruned groups (their hash and their place in the group sets, ~0.8 KB a group) "
        "are deleted too once they were trained this many steps before the last checkpoint (dropped groups: "
        "dropped before that step's checkpoint; at least keep_trained_steps). The group counts go on counting them "
        "(stats forgotten_groups_trained, forgotten_groups_dropped). A resume from a checkpoint older than this "
        "cannot count the groups trained after it, and says so. None keeps every record (a week-long job at 2 s "
        "a step and 32 groups a step: ~8 GB of Redis); nothing is deleted when keep_trained_steps is None.",
    )
    reconnect_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
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

    @model_validator(mode="after")
    def _check_url(self) -> BufferConfig:
        schemes = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
        if self.url is not None and not self.url.startswith(schemes):
            raise ValueError(f"buffer.url must start with one of {', '.join(schemes)} (None: a local redis-server)")
        return self


def resolve_weight_transport(kind: str, learner_device: str, launcher: str = "ray") -> str:
    """weights.transport "auto": in the job's own process (cluster.launcher=local) the engines read
    the learner's tensors directly (inproc); on Ray cuda_ipc when the learner is on CUDA, else
    shared memory."""
    if kind != "auto":
        return kind
    if launcher == "local":
        return "inproc"
    return "cuda_ipc" if learner_device.startswith("cuda") else "shm"


class WeightsConfig(_Strict):
    transport: Literal["auto", "shm", "cuda_ipc", "file", "broadcast", "inproc"] = Field(
        "auto",
        description="auto: inproc with cluster.launcher=local, else cuda_ipc when the learner is on CUDA, else "
        "shared memory; broadcast: a torch.distributed group (NCCL on GPU, gloo on CPU) across processes and "
        "machines; inproc (launcher=local only): the engines copy the learner's tensors in the same process.",
    )
    bucket_mb: float = Field(64.0, gt=0)
    check_every: int = Field(
        1, ge=0, description="Compare engine and learner logprobs on a probe after every Nth update (0: never)."
    )
    checksum_every: int = Field(
        10,
        ge=0,
        description="Compare a checksum of every weight tensor, learner against engine, after every Nth update "
        "(0: never): it sees what the probe cannot, such as an MoE expert only the responses route to. The "
        "built-in engine only (vLLM and SGLang fuse and shard their tensors), not with learner.lora.",
    )
    check_tolerance: float = Field(
        1e-3,
        gt=0,
        description="Largest probe logprob difference allowed. With learner.mixed_precision the learner's probe "
        "runs in bf16 against the engine's own precision: at least 0.15 then (JobConfig.weight_check_tolerance).",
    )


class ClusterConfig(_Strict):
    launcher: Literal["ray", "local"] = Field(
        "ray",
        description="ray: the learner and each rollout worker are Ray actors (one machine or a cluster). local: "
        "the same learner (one rank) and workers run on threads of the driver's process, without Ray: one "
        "machine, one GPU, a debugger that stops in a reward function or the worker loop.",
    )
    ray_address: str | None = Field(
        None,
        description="None: the job starts a Ray of its own; auto: join the cluster this machine belongs to "
        "(what a submitted job does, slime submit); HOST:PORT: that cluster's GCS address.",
    )
    num_cpus: int | None = Field(
        None, gt=0, description="The CPUs of the Ray the job starts itself (or of the local launcher); None: all."
    )
    torch_threads: int = Field(1, gt=0, description="torch threads per actor (2-core boxes: keep 1).")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: learner ranks and rollout engines share the devices (GPUs needed: the larger "
        "of the two counts; in sync mode GPU engines free their KV memory while the learner trains, see "
        "rollout.release_memory). disaggregated: separate devices, each rank and each GPU engine reserves one.",
    )

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.num_cpus is not None and self.ray_address not in (None, "local"):
            raise ValueError(
                f"cluster.num_cpus={self.num_cpus} sizes a Ray the job starts itself; cluster.ray_address="
                f"{self.ray_address} joins a running cluster, whose Ray counts its own CPUs: remove num_cpus"
            )
        return self


class WandbConfig(_Strict):
    """Weights & Biases (slime/tracking.py, docs/tracking.md): every step's metrics and the redacted config."""

    project: str = Field(min_length=1, description="The W&B project.")
    entity: str | None = Field(None, description="Team or user that owns the project; default: the API key's.")
    name: str | None = Field(None, description="The run's display name; default: the run directory's name.")
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")
    mode: Literal["online", "offline"] = Field(
        "offline",
        description="offline: written under DIR/wandb/ without any network, uploaded later with `wandb sync`; "
        "online: streamed to the W&B server (needs WANDB_API_KEY or `wandb login`).",
    )
    dir: str | None = Field(None, description="Where the wandb/ folder goes; default: the run directory.")


class MlflowConfig(_Strict):
    """MLflow (slime/tracking.py, docs/tracking.md): every step's metrics, the redacted config as params."""

    tracking_uri: str = Field(
        min_length=1,
        repr=False,  # it may hold a password
        description="The tracking server (http://host:port; credentials via MLFLOW_TRACKING_USERNAME/PASSWORD "
        "or in the URL, never printed), or a local store: sqlite:///path.db, a folder or file: URI.",
    )
    experiment: str = Field("slime", min_length=1, description="Experiment the run goes to (made if missing).")
    run_name: str | None = Field(None, description="The MLflow run's name; default: the run directory's name.")


class LoggingConfig(_Strict):
    jsonl: bool = True
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    wandb: WandbConfig | None = Field(
        None, description="Also track the run in Weights & Biases (pip install wandb); None: off."
    )
    mlflow: MlflowConfig | None = Field(
        None, description="Also track the run in MLflow (pip install mlflow-skinny); None: off."
    )


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
