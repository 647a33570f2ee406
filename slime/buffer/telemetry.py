"""The job's telemetry and controls: events, engine health, step metrics, job info, expert load and
the control record (pause, oversample) the driver honours; and the only writes the dashboard
makes (pause, resume, oversample, requeue or drop one trajectory).

Keys (beside the store's, same prefix; the layout is in slime/buffer/__init__.py): events (list,
newest first), control (hash: paused, oversample), engines (hash worker_id -> health JSON),
expert_load (hash 'layer:expert' -> routed tokens), steps (list of per-step metrics JSON),
job_info (JSON string).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from slime.buffer.connection import JobConnection, ScriptReply
from slime.security import redact_url

EVENTS_KEPT = 1000
STEPS_KEPT = 500


class JobTelemetry:
    """What the driver, the workers and the dashboard tell each other about one job."""

    def __init__(self, connection: JobConnection) -> None:
        self.connection = connection
        self.job, self.redis = connection.job, connection.redis
        self._key = connection.key
        self._force_requeue = connection.script("transitions.lua", "force_requeue.lua")
        self._drop_sample = connection.script("transitions.lua", "drop_sample.lua")

    @classmethod
    def open(cls, url: str, job: str, *, password: str | None = None) -> JobTelemetry:
        """Telemetry on a connection of its own (see `JobConnection` for ``password``)."""
        return cls(JobConnection(url, job, password=password))

    # Pickled (Ray actor arguments): the copy opens its own connection, password kept.
    def __reduce__(self) -> tuple:
        return (JobTelemetry, (self.connection,))

    def __repr__(self) -> str:
        return f"JobTelemetry(job={self.job!r}, url={redact_url(self.connection.url)!r})"

    # ---- events ---------------------------------------------------------------------------------

    def log_event(self, kind: str, detail: dict[str, Any]) -> dict[str, Any]:
        event = {"ts": self.connection.server_time(), "kind": kind, "detail": detail}
        pipe = self.connection.pipeline(transaction=True)
        pipe.lpush(self._key("events"), json.dumps(event))
        pipe.ltrim(self._key("events"), 0, EVENTS_KEPT - 1)
        pipe.execute()
        return event

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` events, newest first."""
        return [json.loads(e) for e in self.redis.lrange(self._key("events"), 0, max(0, limit - 1))]

    # ---- controls -------------------------------------------------------------------------------

    def set_control(self, **fields: str) -> None:
        """Fields of the control record: paused ('0'|'1'), oversample (a float's repr)."""
        self.redis.hset(self._key("control"), mapping=fields)

    def get_control(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(self._key("control")).items()}

    def force_requeue(self, sample_id: str) -> None:
        """A RUNNING sample back to the front of the resume queue, tokens kept (its worker drops it)."""
        code, detail = self._force_requeue(args=[self.connection.prefix, sample_id])
        self._raise_for_control(code, detail, sample_id, "requeue", "running")

    def drop_sample(self, sample_id: str, reason: str) -> str:
        """An unfinished (pending, aborted or running) sample becomes FAILED with `reason`.
        Returns the status it had."""
        code, detail = self._drop_sample(args=[self.connection.prefix, sample_id, reason])
        self._raise_for_control(code, detail, sample_id, "drop", "pending, aborted or running")
        return detail.decode()

    def _raise_for_control(self, code: int, detail: bytes, sample_id: str, action: str, allowed: str) -> None:
        if code == ScriptReply.NO_SAMPLE:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        if code != ScriptReply.OK:
            raise ValueError(f"cannot {action} sample {sample_id!r}: its status is {detail.decode()}, not {allowed}")

    # ---- engines --------------------------------------------------------------------------------

    def record_engine_health(self, healths: Sequence[dict[str, Any]]) -> None:
        if healths:
            now = self.connection.server_time()
            self.redis.hset(
                self._key("engines"),
                mapping={
                    str(h.get("worker_id", i)): json.dumps({**h, "published_at": now}) for i, h in enumerate(healths)
                },
            )

    def engine_health(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in self.redis.hgetall(self._key("engines")).items()}

    def forget_engine(self, worker_id: str) -> None:
        """A worker left the job (elastic rollout): the dashboard stops showing its last health."""
        self.redis.hdel(self._key("engines"), worker_id)

    def add_expert_load(self, counts: np.ndarray) -> None:
        """Add routed-token counts, shape (layers, experts)."""
        pipe = self.connection.pipeline(transaction=False)
        for (layer, expert), n in np.ndenumerate(np.asarray(counts)):
            if n:
                pipe.hincrby(self._key("expert_load"), f"{layer}:{expert}", int(n))
        pipe.execute()

    def expert_load(self) -> np.ndarray:
        """Routed-token counts (layers, experts); shape (0, 0) when none were recorded."""
        raw = self.redis.hgetall(self._key("expert_load"))
        cells = {tuple(int(x) for x in k.decode().split(":")): int(v) for k, v in raw.items()}
        if not cells:
            return np.zeros((0, 0), dtype=np.int64)
        out = np.zeros((max(layer for layer, _ in cells) + 1, max(e for _, e in cells) + 1), dtype=np.int64)
        for (layer, expert), n in cells.items():
            out[layer, expert] = n
        return out

    # ---- steps and the job ----------------------------------------------------------------------

    def record_step(self, step: int, metrics: dict[str, float]) -> None:
        pipe = self.connection.pipeline(transaction=True)
        pipe.rpush(self._key("steps"), json.dumps({"step": step, **metrics}))
        pipe.ltrim(self._key("steps"), -STEPS_KEPT, -1)
        pipe.execute()

    def step_history(self, limit: int = STEPS_KEPT) -> list[dict[str, float]]:
        return [json.loads(s) for s in self.redis.lrange(self._key("steps"), -max(1, limit), -1)]

    def set_job_info(self, info: dict[str, Any]) -> None:
        self.redis.set(self._key("job_info"), json.dumps(info))

    def job_info(self) -> dict[str, Any]:
        raw = self.redis.get(self._key("job_info"))
        return json.loads(raw) if raw else {}
