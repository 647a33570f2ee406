"""What the buffer API answers and accepts: pydantic models, so the OpenAPI schema is exact."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slime.sample import Status

# Ids become parts of Redis key names under this job's prefix: no ':' or '*' can get through.
ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_PAGE = 200
MAX_SCAN = 2000
MAX_WINDOW = 5000

GroupStage = Literal["open", "ready", "claimed", "trained", "dropped"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Summary(_Strict):
    job: str
    policy_version: int
    step: int | None = Field(None, description="Last finished training step (None before the first).")
    total_steps: int | None = None
    paused: bool
    oversample: float | None = Field(None, description="APRIL over-provisioning in effect (override or config).")
    samples_by_status: dict[str, int]
    groups: dict[str, int] = Field(description="Groups by stage: total, open, ready, claimed, trained, dropped.")
    queues: dict[str, int] = Field(description="Lengths of the resume, new and ready queues; running leases.")
    generated_tokens: float
    tokens_per_s: float = Field(
        description="Generated tokens per second over the last ~10 s of this server's polls (0 until it has two)."
    )
    staleness_max: int = Field(description="Policy version minus the oldest token version among unfinished samples.")
    staleness_mean: float
    server_time: float
    read_only: bool = Field(
        False, description="A finished run's copy (`slime dashboard RUN_DIR`): control routes answer 409."
    )


class TrajectoryRow(_Strict):
    id: str
    group_id: str
    index: int
    status: Status
    reward: float | None
    failure: str | None
    response_length: int
    max_new_tokens: int
    min_version: int | None
    max_version: int | None
    version_span: int | None = Field(description="max_version - min_version: policy versions the response spans.")
    created_at: float
    updated_at: float
    age_s: float


class TrajectoryPage(_Strict):
    items: list[TrajectoryRow]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; None at the end.")
    scanned: int = Field(description="Samples examined for this page (bounded by max_scan).")


class GroupRow(_Strict):
    id: str
    stage: str
    n: int
    done: int
    created_at: float
    claimed_step: int | None
    prompt_text: str | None
    sample_ids: list[str]


class GroupPage(_Strict):
    items: list[GroupRow]
    next_cursor: str | None


class Token(_Strict):
    id: int
    text: str
    logprob: float
    version: int
    loss_mask: int


class Trajectory(_Strict):
    row: TrajectoryRow
    prompt_ids: list[int]
    prompt_text: str
    response_text: str
    tokens: list[Token]
    token_rewards: list[float] | None
    metadata: dict[str, Any]
    policy_version: int


class Histogram(_Strict):
    edges: list[float]
    counts: list[int]
    n: int
    mean: float | None
    p50: float | None
    p99: float | None


class Histograms(_Strict):
    window: int = Field(description="Newest trajectories the histograms cover.")
    response_length: Histogram
    version_span: Histogram
    reward: Histogram
    staleness: Histogram


class EngineLoad(_Strict):
    worker_id: str
    alive: bool
    version: int | None
    running: int
    waiting: int
    scoring: int
    generated_tokens: int
    busy_fraction: float
    published_at: float
    age_s: float


class ExpertLoad(_Strict):
    available: bool
    reason: str | None = Field(None, description="Why there is no data, when available is false.")
    counts: list[list[int]] = Field(description="Routed tokens per [layer][expert].")
    share: list[float] = Field(description="Each expert's share of routed tokens, all layers summed.")


class RewardStats(_Strict):
    window: int
    scored: int
    failed: int
    mean: float | None
    std: float | None
    failure_reasons: dict[str, int] = Field(description="Failures by the first line of their reason.")
    latency_p50_s: float | None
    latency_p99_s: float | None
    per_step: list[dict[str, float]] = Field(description="reward_stats/* and reward_mean of recent steps.")


class StepPoint(_Strict):
    model_config = ConfigDict(extra="allow")
    step: int


class Event(_Strict):
    ts: float
    kind: str
    detail: dict[str, Any]


class DropRequest(_Strict):
    reason: str = Field("dropped from the dashboard", min_length=1, max_length=200)


class OversampleRequest(_Strict):
    oversample: float = Field(ge=1.0, le=16.0, description="Groups in flight = ceil(oversample * batch_size).")


class ControlState(_Strict):
    paused: bool
    oversample: float | None
    event: Event
