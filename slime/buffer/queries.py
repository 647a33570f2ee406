"""Read-only queries the dashboard makes: listing and filtering trajectories inside Redis (one
round trip, bounded work), group pages by creation rank (the `groups` zset is the index, no SCAN),
light per-sample rows, the staleness of unfinished work and the summary's facts. Nothing here writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.buffer.connection import JobConnection
from slime.buffer.records import (
    FORGOTTEN_GROUP_STATS,
    WIRE_VERSION,
    load_samples,
    read_counts,
    read_policy_version,
)
from slime.sample import Sample
from slime.security import redact_url

# The sample hash fields of a light row, in the order scan_rows.lua returns them.
ROW_FIELDS = ("group_id", "index", "status", "reward", "failure", "created_at", "updated_at", "max_new_tokens")


@dataclass(frozen=True)
class SummaryFacts:
    """What the dashboard's summary reads in one round trip (beside the store's counts)."""

    server_time: float
    generated_tokens: float
    policy_version: int
    control: dict[str, str]
    last_step: dict[str, Any] | None
    job_info: dict[str, Any]
    first_versions: list[int]  # of up to 256 running and 256 aborted samples with tokens


class BufferQueries:
    """The dashboard's reads of one job."""

    def __init__(self, connection: JobConnection) -> None:
        self.connection = connection
        self.job, self.redis = connection.job, connection.redis
        self._key = connection.key
        self._scan_rows = connection.script("scan_rows.lua")
        self._first_versions = connection.script("first_versions.lua")

    @classmethod
    def open(cls, url: str, job: str, *, password: str | None = None) -> BufferQueries:
        """Queries on a connection of their own (see `JobConnection` for ``password``)."""
        return cls(JobConnection(url, job, password=password))

    # Pickled (Ray actor arguments): the copy opens its own connection, password kept.
    def __reduce__(self) -> tuple:
        return (BufferQueries, (self.connection,))

    def __repr__(self) -> str:
        return f"BufferQueries(job={self.job!r}, url={redact_url(self.connection.url)!r})"

    def server_time(self) -> float:
        return self.connection.server_time()

    # ---- the store's facts, read only ----------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """As `TrajectoryStore.counts`: samples by status, queues, groups by stage, leases."""
        return read_counts(self.connection)

    def get_policy_version(self) -> int:
        return read_policy_version(self.connection)

    def get_sample(self, sample_id: str) -> Sample:
        samples = load_samples(self.connection, [sample_id])
        if not samples:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        return samples[0]

    def summary_facts(self) -> SummaryFacts:
        pipe = self.connection.pipeline(transaction=False)
        pipe.time()
        pipe.hget(self._key("stats"), "generated_tokens")
        pipe.get(self._key("policy_version"))
        pipe.hgetall(self._key("control"))
        pipe.lindex(self._key("steps"), -1)
        pipe.get(self._key("job_info"))
        self._first_versions(args=[self.connection.prefix, 256], client=pipe)
        (sec, usec), generated, version, control, last_step, info, firsts = pipe.execute()
        return SummaryFacts(
            server_time=sec + usec / 1e6,
            generated_tokens=float(generated or 0.0),
            policy_version=int(version or 0),
            control={k.decode(): v.decode() for k, v in control.items()},
            last_step=json.loads(last_step) if last_step else None,
            job_info=json.loads(info) if info else {},
            first_versions=[int(v) for v in firsts],
        )

    def first_versions(self, max_each: int = 256) -> list[int]:
        """First-token policy versions of up to max_each running and max_each aborted samples."""
        return [int(v) for v in self._first_versions(args=[self.connection.prefix, int(max_each)])]

    # ---- groups -------------------------------------------------------------------------------------

    def _forgotten_groups(self) -> int:
        """Groups whose records a long job deleted (buffer.keep_group_records_steps): the oldest, as a
        rule. Creation ranks count them, so a page cursor stays on its group when they go."""
        values = self.redis.hmget(self._key("stats"), *FORGOTTEN_GROUP_STATS)
        return sum(int(float(v or 0)) for v in values)

    def group_count(self) -> int:
        return int(self.redis.zcard(self._key("groups"))) + self._forgotten_groups()

    def group_ids_by_rank(self, lo: int, hi: int) -> list[str]:
        """Group ids of creation ranks lo..hi (0 = oldest, forgotten groups counted; the `groups` zset
        is the index, no SCAN). Ranks are stable while groups are added and old ones forgotten, so
        they make page cursors."""
        forgotten = self._forgotten_groups()
        if hi >= 0:  # a negative hi counts from the newest, as ZRANGE's
            if hi < forgotten:
                return []
            hi -= forgotten
        return [g.decode() for g in self.redis.zrange(self._key("groups"), max(0, lo - forgotten), hi)]

    def group_rows(self, group_ids: Sequence[str]) -> list[tuple[dict[str, str], list[str]]]:
        """Per group: its hash fields and its sample ids, in one round trip."""
        pipe = self.connection.pipeline(transaction=False)
        for gid in group_ids:
            pipe.hgetall(self._key("group", gid))
            pipe.lrange(self._key("group", gid, "samples"), 0, -1)
        replies = pipe.execute()
        return [
            ({k.decode(): v.decode() for k, v in replies[2 * i].items()}, [s.decode() for s in replies[2 * i + 1]])
            for i in range(len(group_ids))
        ]

    # ---- trajectories ---------------------------------------------------------------------------------

    def scan_rows(
        self,
        rank: int,
        pos: int,
        limit: int,
        max_scan: int,
        statuses: Sequence[str] = (),
        bounds: dict[str, tuple[float | None, float | None]] | None = None,
    ) -> tuple[list[dict[str, Any]], int, int, int, float]:
        """Newest-first listing done inside Redis (one call, at most max_scan samples examined):
        light rows (as `sample_rows`) matching the statuses and the (low, high) bounds on `length`,
        `reward`, `version_span` and `age_s` (by the Redis server's clock). Returns (rows, next rank,
        next pos, scanned, server time); rank -1 means the oldest group was passed."""
        bounds = bounds or {}
        args: list[Any] = [
            self.connection.prefix,
            int(rank),
            int(pos),
            int(limit),
            int(max_scan),
            "," + ",".join(statuses) + "," if statuses else "",
        ]
        for name in ("length", "reward", "version_span", "age_s"):
            for value in bounds.get(name, (None, None)):
                args.append("" if value is None else repr(float(value)))
        next_rank, next_pos, scanned, flat, server_time = self._scan_rows(args=args)
        rows = []
        for i in range(0, len(flat), 12):
            sid, *fields, length, first, last = (v.decode() for v in flat[i : i + 12])
            row: dict[str, Any] = {"id": sid}
            for name, value in zip(ROW_FIELDS, fields):
                row[name] = value if value != "" else None
            row["response_length"] = int(length)
            row["min_version"] = int(first) if first != "" else None
            row["max_version"] = int(last) if last != "" else None
            rows.append(row)
        return rows, int(next_rank), int(next_pos), int(scanned), float(server_time)

    def sample_rows(self, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Light per-sample rows (no token arrays) in one round trip: the hash fields above plus
        response length and the first/last token's policy version (versions never decrease)."""
        pipe = self.connection.pipeline(transaction=False)
        for sid in sample_ids:
            key = self._key("sample", sid)
            pipe.hmget(key, ROW_FIELDS)
            pipe.strlen(key + ":mask")
            pipe.getrange(key + ":ver", 0, 3)
            pipe.getrange(key + ":ver", -4, -1)
        replies = pipe.execute()
        rows = []
        for i, sid in enumerate(sample_ids):
            values, length, first, last = replies[4 * i : 4 * i + 4]
            if values[0] is None:
                continue  # deleted meanwhile
            row: dict[str, Any] = {"id": sid}
            for name, value in zip(ROW_FIELDS, values):
                row[name] = value.decode() if value is not None else None
            row["response_length"] = int(length)
            row["min_version"] = int(np.frombuffer(first, WIRE_VERSION)[0]) if len(first) == 4 else None
            row["max_version"] = int(np.frombuffer(last, WIRE_VERSION)[0]) if len(last) == 4 and length else None
            rows.append(row)
        return rows
