"""The simulator's settings (`SimConfig`) and its presets; april/sim/run.py runs them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICIES: tuple[str, ...] = ("sync", "april", "april_drop", "one_step_async", "async_bounded")


class SimConfig(BaseModel):
    """Every knob of the model. The defaults are the `paper` preset (8 GPU engines, 16k tokens)."""

    model_config = ConfigDict(extra="forbid")

    # cluster
    engines: int = Field(8, gt=0, description="Rollout engines (one per GPU / rollout worker).")
    slots: int = Field(64, gt=0, description="Max concurrent requests per engine (max_running_requests).")
    kv_tokens: int = Field(
        350_000, gt=0, description="KV budget K per engine, tokens (prompt + generated) of running requests."
    )
    # workload
    batch_size: int = Field(64, gt=0, description="B: prompt groups per training step.")
    n_samples: int = Field(8, gt=0, description="Responses per prompt (group size).")
    prompt_tokens: int = Field(512, ge=0)
    max_tokens: int = Field(16_384, gt=0, description="Response length cap (max_new_tokens).")
    median_tokens: float = Field(2048.0, gt=0, description="Median response length m.")
    sigma_prompt: float = Field(0.6, ge=0, description="Log-normal sigma of a prompt's median around m.")
    sigma_sample: float = Field(0.5, ge=0, description="Log-normal sigma of a sample around its prompt's median.")
    lengths: list[int] | None = Field(
        None, description="Empirical response lengths, sampled with replacement (replaces the log-normal)."
    )
    length_growth: float = Field(
        1.0,
        gt=0,
        description="Response lengths of a group started at trainer version v are drawn x length_growth**v "
        "(RL on reasoning tasks: responses lengthen as training goes on; the balance of rollout and "
        "training shifts). 1: one fixed distribution.",
    )
    filter_rate: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of groups a dynamic-sampling filter drops when they complete (DAPO's zero reward "
        "variance); drawn per group from its own seeded stream, so every policy drops the same groups. "
        "Modelled for the wave policies (sync, april, april_drop).",
    )
    refill: Literal["group", "batch"] = Field(
        "group",
        description="How the wave policies start groups. group (this project): APRIL keeps ceil(r*B) in flight "
        "and starts one group per finished or filtered group; sync starts one per filtered group. batch "
        "(slime's rollout loop, the APRIL paper's runs): while kept + in-flight groups < B, submit a chunk "
        "of ceil(r*B) groups (B for sync), partials first; at the end sync drops what is still in flight.",
    )
    # engine timing (seconds)
    t0: float = Field(0.006, ge=0, description="Decode step time at batch 0 (weights read, launch overhead).")
    k: float = Field(5e-5, ge=0, description="Decode step time per running request (MLP, sampling).")
    t_kv: float = Field(
        5e-8, ge=0, description="Decode step time per cached KV token of the running requests (attention reads)."
    )
    p: float = Field(2e-5, ge=0, description="Prefill time per prefix token of an admitted request.")
    resume_from_kept_kv: bool = Field(
        False,
        description="An aborted partial keeps its KV cache on its engine (the built-in engine's "
        "rollout.kept_kv_tokens): resumed there, it pays no prefill; on another engine it prefills.",
    )
    shared_prompt_prefill: bool = Field(
        True,
        description="Fresh samples of one group admitted to an engine together pay their shared prompt's "
        "prefill once (the built-in engine feeds identical contexts once; vLLM's and SGLang's prefix caches "
        "do the same).",
    )
    # learner timing (seconds)
    t_sync: float = Field(5.0, ge=0, description="Weight sync (learner -> engines) per step.")
    t_train0: float = Field(10.0, ge=0, description="Fixed cost of a training step.")
    t_train_per_token: float = Field(2e-5, ge=0, description="Training cost per (prompt + response) token.")
    gpu_pool: int | None = Field(
        None,
        gt=0,
        description="GPUs the engines and the learner share: one per engine (also while it starts), the rest "
        "train, and t_train_per_token is then the time per token on one GPU (divided by the learner's GPUs). "
        "None: t_train_per_token is the learner's, whatever the engine count.",
    )
    # elastic rollout (april/elastic.py; the job's rollout.elastic), modelled for async_bounded
    elastic: bool = Field(False, description="compare also runs async_bounded with elastic rollout.")
    elastic_min_engines: int = Field(1, gt=0)
    elastic_max_engines: int = Field(16, gt=0)
    elastic_low_watermark: float = Field(0.5, ge=0, le=1, description="Fill at or below this: add an engine.")
    elastic_high_watermark: float = Field(1.0, gt=0, le=1, description="Fill at or above this: remove an engine.")
    elastic_cooldown_steps: int = Field(2, ge=0, description="Steps observed after a change; their mean fill decides.")
    t_engine_start: float = Field(
        30.0, ge=0, description="Seconds from adding an engine to its first step (start, model load, weights)."
    )
    # run
    steps: int = Field(20, gt=0, description="Training steps simulated per policy.")
    oversample: float = Field(2.0, ge=1.0, description="APRIL default over-provisioning ratio.")
    max_staleness: int = Field(1, ge=1, description="async_bounded default staleness budget.")
    compare_oversample: list[float] = Field(default_factory=lambda: [1.5, 2.0, 3.0])
    compare_staleness: list[int] = Field(default_factory=lambda: [1, 2])
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.kv_tokens < self.prompt_tokens + self.max_tokens:
            raise ValueError(
                f"kv_tokens={self.kv_tokens} cannot hold one request of prompt_tokens + max_tokens = "
                f"{self.prompt_tokens + self.max_tokens} tokens"
            )
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError("lengths must be a non-empty list of positive token counts")
        if any(r < 1 for r in self.compare_oversample):
            raise ValueError("compare_oversample ratios must be >= 1")
        if any(s < 1 for s in self.compare_staleness):
            raise ValueError("compare_staleness budgets must be >= 1")
        if self.elastic:
            if not self.elastic_min_engines <= self.engines <= self.elastic_max_engines:
                raise ValueError(
                    f"engines={self.engines} must lie within elastic_min_engines={self.elastic_min_engines} "
                    f"and elastic_max_engines={self.elastic_max_engines}"
                )
            if self.elastic_low_watermark >= self.elastic_high_watermark:
                raise ValueError("elastic_low_watermark must be below elastic_high_watermark")
            if self.wave_policies_only:
                raise ValueError("elastic is modelled for async_bounded, which models no filter_rate or refill=batch")
        top = self.elastic_max_engines if self.elastic else self.engines
        if self.gpu_pool is not None and self.gpu_pool <= top:
            raise ValueError(f"gpu_pool={self.gpu_pool} leaves the learner no GPU with {top} engines")
        return self

    @property
    def wave_policies_only(self) -> bool:
        """The async policies do not model a filter or slime's chunked refill."""
        return self.filter_rate > 0 or self.refill == "batch"


PRESETS: dict[str, SimConfig] = {
    # The APRIL paper's setting: 8 engines x 64 slots, 16k cap, 2x over-provisioning, B*n = 512 =
    # the slots, a long-tailed reasoning workload (median 2k, mean ~2.75k, 0.3% at the cap).
    # One H100 per engine serving a ~4B model (Qwen3-4B-like: 8 GB bf16 weights, 36 layers x 8 KV
    # heads x 128 dims = 147 KB of KV per token, ~3 TB/s HBM, ~1 PFLOP/s bf16):
    #   t0   = 6 ms      weights read (8 GB / 3 TB/s = 2.7 ms) + launch, sampling, scheduler
    #   k    = 50 us     per request: MLP/projection FLOPs (8 GFLOP at ~50% MFU) + bookkeeping
    #   t_kv = 50 ns     per cached token per step: its 147 KB of KV read at ~3 TB/s
    #   p    = 20 us     per prefilled token: 8 GFLOP at ~50% MFU, plus attention
    #   K    = 350k      tokens of KV pool (~52 GB after weights and activations)
    # Colocated training on the same 8 GPUs: ~58 GFLOP per token (old/ref log-prob forwards,
    # forward, backward, recompute) at 40% MFU -> ~50k tok/s -> 2e-5 s/token, 10 s fixed
    # (offload/onload, optimizer), 5 s weight sync.
    "paper": SimConfig(),
    # The runs behind the APRIL paper's figures, as its published scripts set them (Qwen3-4B,
    # DAPO-Math-17k, 8 GPUs colocated): 4 SGLang engines of tensor parallel 2, 32 prompts x 8
    # samples per step, 2x over-sampling (64 prompts), 16k cap, the DAPO zero-variance filter in
    # both arms, and slime's rollout loop (refill=batch: the baseline over-submits a whole batch
    # whenever the filter drops a group, and discards what is in flight at the end; APRIL keeps
    # it). Per engine: 2 GPUs at mem fraction 0.6 -> ~88 GB of KV pool at 74 KB/token per GPU ->
    # 600k tokens; weights read per GPU halve (1.35 ms) plus ~0.7 ms of all-reduces, FLOPs and
    # KV reads per GPU halve: t0 5.5 ms, k 42 us, t_kv 25 ns, p 10 us. Slots never bind (SGLang
    # sizes its running batch by the KV pool). The filter rate (half the groups have zero reward
    # variance) is an assumption; docs/april_simulator.md sweeps it. Lengths as in `paper`.
    "paper_runs": SimConfig(
        engines=4,
        slots=512,
        kv_tokens=600_000,
        batch_size=32,
        t0=0.0055,
        k=4.2e-5,
        t_kv=2.5e-8,
        p=1e-5,
        filter_rate=0.5,
        refill="batch",
        compare_oversample=[2.0],
    ),
    # This machine's CPU engine with the tiny MoE on the example (repeat) task; to be calibrated.
    "cpu_tiny": SimConfig(
        engines=1,
        slots=64,
        kv_tokens=64 * 512,
        batch_size=8,
        n_samples=4,
        prompt_tokens=6,
        max_tokens=96,
        median_tokens=6.0,
        sigma_prompt=0.9,
        sigma_sample=0.75,
        t0=0.006,
        k=0.0003,
        t_kv=0.0,
        p=2e-5,
        t_sync=0.05,
        t_train0=0.3,
        t_train_per_token=2e-4,
        steps=30,
    ),
}
