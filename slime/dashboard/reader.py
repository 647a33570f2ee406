"""Read-side views of one job's buffer for the API: bounded work per call, no SCAN.

Listing walks the `groups` zset from the newest group down (ranks are stable under inserts, so a
cursor "<group rank>.<sample position>" never repeats or skips a trajectory); a Lua script reads
and filters light rows (hash fields, response length, first/last token version) inside Redis. One
call examines at most `max_scan` samples and hands back a cursor.

Distributions (histograms, reward stats) and the step history are computed in Python from
shared snapshots, each read at most once per TTL whatever the parameters: the newest trajectories
(with the policy version) in two sizes, `SNAPSHOT_SIZES` (the page's 500, ~4 ms of Redis time;
`MAX_WINDOW`, ~75 ms, read only while someone asks for more than 500), and the last `STEPS_KEPT`
steps. A caller sweeping `window`/`bins`/`limit` therefore costs no Redis work beyond those.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.buffer.queries import BufferQueries
from slime.buffer.telemetry import STEPS_KEPT, JobTelemetry
from slime.dashboard import schemas as S
from slime.sample import Status

CURSOR_PATTERN = r"^\d{1,10}\.\d{1,6}$"
_GROUP_BATCH = 32
_NEWEST = 1 << 40  # a rank past the newest group; the listing script clamps it
SNAPSHOT_SIZES = (500, S.MAX_WINDOW)
ROWS_TTL_S = 3.0  # a page's refresh period: the scan runs inside Redis, where rollout workers append
STEPS_TTL_S = 0.5  # every open page asks when a step ends


@dataclass(frozen=True)
class TrajectoryFilter:
    statuses: frozenset[Status] = frozenset()
    min_version_span: int | None = None
    max_version_span: int | None = None
    min_age_s: float | None = None
    max_age_s: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None


def _row(raw: dict[str, Any], now: float) -> dict[str, Any]:
    """A TrajectoryRow as a plain dict: list pages are the hot path, and building pydantic models
    for thousands of rows costs more than the Redis work (the API test checks them against the schema)."""
    lo, hi = raw["min_version"], raw["max_version"]
    created = float(raw["created_at"])
    return {
        "id": raw["id"],
        "group_id": raw["group_id"],
        "index": int(raw["index"]),
        "status": raw["status"],
        "reward": _finite_or_none(float(raw["reward"])) if raw["reward"] is not None else None,
        "failure": raw["failure"],
        "response_length": raw["response_length"],
        "max_new_tokens": int(raw["max_new_tokens"]),
        "min_version": lo,
        "max_version": hi,
        "version_span": hi - lo if lo is not None and hi is not None else None,
        "created_at": created,
        "updated_at": float(raw["updated_at"]),
        "age_s": max(0.0, now - created),
    }


def _histogram(values: list[float], bins: int, integer: bool) -> S.Histogram:
    if not values:
        return S.Histogram(edges=[], counts=[], n=0, mean=None, p50=None, p99=None)
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return S.Histogram(edges=[], counts=[], n=0, mean=None, p50=None, p99=None)
    lo, hi = float(arr.min()), float(arr.max())
    if integer:  # one bin per integer when they fit, so spans 0, 1, 2 are not blurred
        hi_edge = hi + 1
        step = max(1.0, math.ceil((hi_edge - lo) / bins))
        edges = np.arange(lo, hi_edge + step, step)
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    counts, edges = np.histogram(arr, bins=edges)
    return S.Histogram(
        edges=[float(e) for e in edges],
        counts=[int(c) for c in counts],
        n=int(arr.size),
        mean=float(arr.mean()),
        p50=float(np.percentile(arr, 50)),
        p99=float(np.percentile(arr, 99)),
    )


class BufferReader:
    """Everything the API reads, for one job (fixed at construction)."""

    def __init__(self, queries: BufferQueries, telemetry: JobTelemetry, read_only: bool = False):
        self.queries = queries
        self.read_only = read_only
        self.telemetry = telemetry
        self.job = queries.job
        self._throughput: deque[tuple[float, float]] = deque(maxlen=128)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Any]] = {}  # a fixed set of keys: "rows-<size>", "steps"
        self._building: dict[str, threading.Lock] = {}
        self._tokenizer: Any = None
        self._tokenizer_dir: str | None = None

    # ---- summary -------------------------------------------------------------------------------
    def summary(self) -> S.Summary:
        facts = self.queries.summary_facts()
        counts = self.queries.counts()
        now, generated, version = facts.server_time, facts.generated_tokens, facts.policy_version
        control, info, step = facts.control, facts.job_info, facts.last_step
        staleness = [version - v for v in facts.first_versions]
        oversample = float(control["oversample"]) if "oversample" in control else info.get("oversample")
        return S.Summary(
            job=self.job,
            policy_version=version,
            step=int(step["step"]) if step else None,
            total_steps=info.get("steps"),
            paused=control.get("paused") == "1",
            oversample=oversample if info.get("april_enabled", True) else None,
            samples_by_status={s.value: counts[s.value] for s in Status},
            groups={k.removeprefix("groups_"): v for k, v in counts.items() if k.startswith("groups_")},
            queues={
                "resume": counts["queue_resume"],
                "new": counts["queue_new"],
                "ready": counts["queue_ready"],
                "leases": counts["leases"],
            },
            generated_tokens=generated,
            tokens_per_s=self._rate(now, generated),
            staleness_max=max(staleness, default=0),
            staleness_mean=float(np.mean(staleness)) if staleness else 0.0,
            server_time=now,
            read_only=self.read_only,
        )

    def _rate(self, now: float, generated: float) -> float:
        with self._lock:
            points = self._throughput
            if not points or now - points[-1][0] >= 0.25:
                points.append((now, generated))
            recent = [p for p in points if now - p[0] <= 10.0]
        if len(recent) < 2 or recent[-1][0] - recent[0][0] <= 0:
            return 0.0
        return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))

    # ---- listing ---------------------------------------------------------------------------------
    def trajectories(self, flt: TrajectoryFilter, limit: int, cursor: str | None, max_scan: int) -> dict[str, Any]:
        """Filtering runs inside Redis (BufferQueries.scan_rows), so a page costs one round trip."""
        rank, pos = (_NEWEST, 0) if cursor is None else self._start(cursor)
        bounds = {
            "length": (flt.min_length, flt.max_length),
            "reward": (flt.min_reward, flt.max_reward),
            "version_span": (flt.min_version_span, flt.max_version_span),
            "age_s": (flt.min_age_s, flt.max_age_s),
        }
        rows, rank, pos, scanned, now = self.queries.scan_rows(
            rank, pos, limit, max_scan, sorted(s.value for s in flt.statuses), bounds
        )
        return {
            "items": [_row(r, now) for r in rows],
            "next_cursor": f"{rank}.{pos}" if rank >= 0 else None,
            "scanned": scanned,
        }

    def groups(self, stages: frozenset[str], limit: int, cursor: str | None) -> S.GroupPage:
        rank, _ = self._start(cursor)
        items: list[S.GroupRow] = []
        examined = 0
        while rank >= 0 and len(items) < limit and examined < 500:  # bounded work per call
            lo = max(0, rank - max(limit, _GROUP_BATCH) + 1)
            gids = self.queries.group_ids_by_rank(lo, rank)[::-1]
            for gid, (fields, sids) in zip(gids, self.queries.group_rows(gids)):
                examined += 1
                rank -= 1
                if fields and (not stages or fields.get("status") in stages):
                    items.append(_group_row(gid, fields, sids))
                    if len(items) >= limit:
                        break
            if not gids:
                rank = -1
        return S.GroupPage(items=items, next_cursor=f"{rank}.0" if rank >= 0 else None)

    def group(self, group_id: str) -> S.GroupRow:
        fields, sids = self.queries.group_rows([group_id])[0]
        if not fields:
            raise KeyError(f"group {group_id!r} not found in job {self.job!r}")
        return _group_row(group_id, fields, sids)

    def _start(self, cursor: str | None) -> tuple[int, int]:
        if cursor is None:
            return self.queries.group_count() - 1, 0
        rank, pos = cursor.split(".")
        return int(rank), int(pos)

    # ---- one trajectory ------------------------------------------------------------------------
    def trajectory(self, sample_id: str) -> S.Trajectory:
        sample = self.queries.get_sample(sample_id)  # KeyError when absent
        raw = self.queries.sample_rows([sample_id])
        if not raw:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        row = S.TrajectoryRow(**_row(raw[0], self.queries.server_time()))
        tokenizer = self._load_tokenizer()
        ids = sample.response_ids.tolist()
        if tokenizer is not None:
            pieces = [tokenizer.decode([t]) for t in ids]
            prompt_text = tokenizer.decode(sample.prompt_ids.tolist())
            response_text = tokenizer.decode(ids)
        else:  # no tokenizer reachable (e.g. the model directory is on another machine): show ids
            pieces = [f"<{t}>" for t in ids]
            prompt_text = " ".join(f"<{t}>" for t in sample.prompt_ids.tolist())
            response_text = "".join(pieces)
        tokens = [
            S.Token(id=t, text=piece, logprob=_finite(lp), version=int(v), loss_mask=int(m))
            for t, piece, lp, v, m in zip(
                ids, pieces, sample.logprobs.tolist(), sample.versions.tolist(), sample.loss_mask.tolist()
            )
        ]
        rewards = sample.token_rewards
        return S.Trajectory(
            row=row,
            prompt_ids=sample.prompt_ids.tolist(),
            prompt_text=prompt_text,
            response_text=response_text,
            tokens=tokens,
            token_rewards=[_finite(r) for r in rewards.tolist()] if rewards is not None else None,
            metadata=sample.metadata,
            policy_version=self.queries.get_policy_version(),
        )

    def _load_tokenizer(self) -> Any:
        model_dir = self.telemetry.job_info().get("model_dir")
        if model_dir and model_dir != self._tokenizer_dir:
            self._tokenizer_dir = model_dir
            try:
                # Late: slime.model imports torch and transformers (~2 s of the dashboard's start), and
                # only the one-trajectory view needs a tokenizer.
                from slime.model import load_tokenizer

                self._tokenizer = load_tokenizer(model_dir)
            except Exception:
                self._tokenizer = None
        return self._tokenizer

    # ---- distributions ---------------------------------------------------------------------------
    def _newest(self, window: int) -> tuple[list[dict[str, Any]], int]:
        """At least the newest `window` trajectories (newest first) and the policy version, from the
        smallest snapshot size that covers `window` (or a larger one that is fresh)."""
        sizes = [n for n in SNAPSHOT_SIZES if n >= window] or [SNAPSHOT_SIZES[-1]]
        for size in reversed(sizes[1:]):
            hit = self._fresh(f"rows-{size}", ROWS_TTL_S)
            if hit is not None:
                return hit[1]

        def build() -> tuple[list[dict[str, Any]], int]:
            rows = self.trajectories(TrajectoryFilter(), sizes[0], None, sizes[0])["items"]
            return rows, self.queries.get_policy_version()

        return self._cached(f"rows-{sizes[0]}", ROWS_TTL_S, build)

    def newest_rows(self, window: int) -> list[dict[str, Any]]:
        return self._newest(window)[0][:window]

    def histograms(self, window: int, bins: int) -> S.Histograms:
        rows, version = self._newest(window)
        rows = rows[:window]
        return S.Histograms(
            window=len(rows),
            response_length=_histogram([r["response_length"] for r in rows], bins, integer=True),
            version_span=_histogram([r["version_span"] for r in rows if r["version_span"] is not None], bins, True),
            reward=_histogram([r["reward"] for r in rows if r["reward"] is not None], bins, integer=False),
            staleness=_histogram(
                [
                    version - r["min_version"]
                    for r in rows
                    if r["min_version"] is not None and r["status"] not in ("completed", "truncated", "failed")
                ],
                bins,
                integer=True,
            ),
        )

    def engines(self) -> list[S.EngineLoad]:
        now = self.queries.server_time()
        out = []
        for worker_id, h in sorted(self.telemetry.engine_health().items()):
            uptime = float(h.get("uptime_seconds") or 0.0)
            out.append(
                S.EngineLoad(
                    worker_id=worker_id,
                    alive=bool(h.get("alive")),
                    version=h.get("version"),
                    running=int(h.get("running", 0)),
                    waiting=int(h.get("waiting", 0)),
                    scoring=int(h.get("scoring", 0)),
                    generated_tokens=int(h.get("generated_tokens", 0)),
                    busy_fraction=float(h.get("busy_seconds", 0.0)) / uptime if uptime > 0 else 0.0,
                    published_at=float(h["published_at"]),
                    age_s=max(0.0, now - float(h["published_at"])),
                )
            )
        return out

    def experts(self) -> S.ExpertLoad:
        counts = self.telemetry.expert_load()
        if counts.size == 0:
            return S.ExpertLoad(
                available=False,
                counts=[],
                share=[],
                reason="no MoE router counts recorded for this job yet: the built-in engine's workers add them "
                "every few seconds (slime/engines/expert_load.py); dense models and the vLLM/SGLang engines "
                "record none",
            )
        per_expert = counts.sum(axis=0)
        total = int(per_expert.sum())
        return S.ExpertLoad(
            available=True, counts=counts.tolist(), share=[float(c) / total if total else 0.0 for c in per_expert]
        )

    def rewards(self, window: int) -> S.RewardStats:
        rows = self.newest_rows(window)
        rewards = [r["reward"] for r in rows if r["reward"] is not None and r["status"] != "failed"]
        reasons: dict[str, int] = {}
        for r in rows:
            if r["status"] == "failed":
                key = (r["failure"] or "unknown").splitlines()[0][:120]
                reasons[key] = reasons.get(key, 0) + 1
        per_step = [
            {
                k: v
                for k, v in s.items()
                if (k == "step" or k == "reward_mean" or k.startswith("reward_stats/"))
                and isinstance(v, (int, float))
                and math.isfinite(v)
            }
            for s in self._steps()[-50:]
        ]
        last = per_step[-1] if per_step else {}
        p50 = [v for k, v in last.items() if k.endswith("latency_p50_s")]
        p99 = [v for k, v in last.items() if k.endswith("latency_p99_s")]
        return S.RewardStats(
            window=len(rows),
            scored=len(rewards),
            failed=sum(reasons.values()),
            mean=float(np.mean(rewards)) if rewards else None,
            std=float(np.std(rewards)) if rewards else None,
            failure_reasons=reasons,
            latency_p50_s=max(p50) if p50 else None,
            latency_p99_s=max(p99) if p99 else None,
            per_step=per_step,
        )

    def steps(self, limit: int, since_step: int = -1) -> list[dict[str, Any]]:
        """Per-step metrics of the last `limit` steps after `since_step`."""
        return [s for s in self._steps()[-max(1, limit) :] if s["step"] > since_step]

    def _steps(self) -> list[dict[str, Any]]:
        """The whole kept step history, parsed once per STEPS_TTL_S for every caller (a step carries
        a hundred metrics); non-finite values become None (JSON has no NaN)."""

        def build() -> list[dict[str, Any]]:
            return [
                {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in s.items()}
                for s in self.telemetry.step_history(STEPS_KEPT)
            ]

        return self._cached("steps", STEPS_TTL_S, build)

    def _cached(self, key: str, ttl: float, build: Callable[[], Any]) -> Any:
        """`build()`'s value, rebuilt at most once per `ttl`; concurrent misses wait for one build
        (ten pages refreshing together cost one scan)."""
        hit = self._fresh(key, ttl)
        if hit is not None:
            return hit[1]
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            hit = self._fresh(key, ttl)
            if hit is not None:
                return hit[1]
            value = build()
            with self._lock:
                self._cache[key] = (time.monotonic(), value)
            return value

    def _fresh(self, key: str, ttl: float) -> tuple[float, Any] | None:
        with self._lock:
            hit = self._cache.get(key)
        return hit if hit is not None and time.monotonic() - hit[0] < ttl else None

    # ---- Prometheus --------------------------------------------------------------------------------
    def prometheus(self) -> str:
        s = self.summary()
        job = self.job
        lines = [
            "# HELP slime_samples Trajectories in the buffer by status.",
            "# TYPE slime_samples gauge",
            *[f'slime_samples{{job="{job}",status="{k}"}} {v}' for k, v in s.samples_by_status.items()],
            "# HELP slime_groups Prompt groups by stage.",
            "# TYPE slime_groups gauge",
            *[f'slime_groups{{job="{job}",stage="{k}"}} {v}' for k, v in s.groups.items()],
            "# HELP slime_queue_length Buffer queue lengths.",
            "# TYPE slime_queue_length gauge",
            *[f'slime_queue_length{{job="{job}",queue="{k}"}} {v}' for k, v in s.queues.items()],
            "# HELP slime_policy_version Current policy version.",
            "# TYPE slime_policy_version gauge",
            f'slime_policy_version{{job="{job}"}} {s.policy_version}',
            "# HELP slime_generated_tokens_total Tokens generated by the rollout engines.",
            "# TYPE slime_generated_tokens_total counter",
            f'slime_generated_tokens_total{{job="{job}"}} {s.generated_tokens}',
            "# HELP slime_staleness_max Oldest unfinished token's lag in policy versions.",
            "# TYPE slime_staleness_max gauge",
            f'slime_staleness_max{{job="{job}"}} {s.staleness_max}',
            "# HELP slime_rollout_paused 1 while rollout is paused from the dashboard.",
            "# TYPE slime_rollout_paused gauge",
            f'slime_rollout_paused{{job="{job}"}} {int(s.paused)}',
        ]
        engines = self.engines()
        if engines:
            lines += [
                "# HELP slime_engine_busy_fraction Share of uptime an engine spent decoding.",
                "# TYPE slime_engine_busy_fraction gauge",
            ]
            lines += [
                f'slime_engine_busy_fraction{{job="{job}",worker="{e.worker_id}"}} {e.busy_fraction}' for e in engines
            ]
            lines += [
                "# HELP slime_engine_running Requests decoding on an engine.",
                "# TYPE slime_engine_running gauge",
            ]
            lines += [f'slime_engine_running{{job="{job}",worker="{e.worker_id}"}} {e.running}' for e in engines]
        return "\n".join(lines) + "\n"


def _group_row(gid: str, fields: dict[str, str], sids: list[str]) -> S.GroupRow:
    meta = _json(fields.get("metadata")) or {}
    return S.GroupRow(
        id=gid,
        stage=fields.get("status", "open"),
        n=int(fields.get("n", 0)),
        done=int(fields.get("done", 0)),
        created_at=float(fields.get("created_at", 0.0)),
        claimed_step=int(fields["claimed_step"]) if fields.get("claimed_step") else None,
        prompt_text=str(meta["prompt_text"])[:2000] if "prompt_text" in meta else None,
        sample_ids=sids,
    )


def _json(raw: bytes | str | None) -> Any:
    return json.loads(raw) if raw else None


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _finite(x: float) -> float:
    # JSON has no NaN/Infinity; a -inf logprob (a masked-out token) is shown as a very low number.
    return x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)
