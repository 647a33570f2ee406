"""A trajectory as it lies in Redis, and the reads that the store and the dashboard's queries
share: the wire dtypes of the per-token arrays, decoding a sample hash and its arrays, loading
many samples in one MULTI/EXEC, the O(1) counts and the policy version."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from slime.buffer.connection import JobConnection
from slime.sample import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, VERSION_DTYPE, Sample, Status

# On-the-wire dtypes: fixed little-endian so any host reads what any other wrote.
WIRE_TOKEN = "<i4"
WIRE_LOGPROB = "<f4"
WIRE_VERSION = "<i4"
WIRE_MASK = "i1"


def load_samples(connection: JobConnection, sample_ids: Sequence[str]) -> list[Sample]:
    """Read samples (hash and arrays) in one MULTI/EXEC, so each is a consistent snapshot; ids
    without a sample are left out."""
    if not sample_ids:
        return []
    pipe = connection.pipeline(transaction=True)
    for sid in sample_ids:
        key = connection.key("sample", sid)
        pipe.hgetall(key)
        pipe.get(key + ":tok")
        pipe.get(key + ":lp")
        pipe.get(key + ":ver")
        pipe.get(key + ":mask")
        pipe.get(key + ":route")
    replies = pipe.execute()
    samples = []
    for i, sid in enumerate(sample_ids):
        fields, tok, lp, ver, mask, route = replies[6 * i : 6 * i + 6]
        if fields:
            samples.append(decode_sample(sid, fields, tok, lp, ver, mask, route))
    return samples


# Stats of the groups whose records a long job deleted (buffer.keep_group_records_steps): counts and
# listing ranks add them back (scan_rows.lua reads the same two).
FORGOTTEN_GROUP_STATS = ("forgotten_groups_trained", "forgotten_groups_dropped")


def read_counts(connection: JobConnection) -> dict[str, int]:
    """Samples by status, queue lengths, groups by stage and running leases (all O(1) reads)."""
    key = connection.key
    pipe = connection.pipeline(transaction=True)
    pipe.hgetall(key("status_counts"))
    pipe.llen(key("queue", "resume"))
    pipe.llen(key("queue", "new"))
    pipe.llen(key("queue", "ready"))
    pipe.zcard(key("groups"))
    pipe.zcard(key("claimed"))
    pipe.zcard(key("trained"))
    pipe.zcard(key("leases"))
    pipe.zcard(key("dropped"))
    pipe.hmget(key("stats"), *FORGOTTEN_GROUP_STATS)
    by_status, resume, new, ready, groups, claimed, trained, leases, dropped, forgotten = pipe.execute()
    # Groups whose records a long job deleted (buffer.keep_group_records_steps) still count.
    forgotten_trained, forgotten_dropped = (int(float(x or 0)) for x in forgotten)
    groups += forgotten_trained + forgotten_dropped
    trained += forgotten_trained
    dropped += forgotten_dropped
    counts = {status.value: int(by_status.get(status.value.encode(), 0)) for status in Status}
    counts.update(
        queue_resume=resume,
        queue_new=new,
        queue_ready=ready,
        groups_total=groups,
        groups_ready=ready,
        groups_claimed=claimed,
        groups_trained=trained,
        groups_dropped=dropped,
        groups_open=groups - ready - claimed - trained - dropped,  # still being generated
        leases=leases,
    )
    return counts


def read_policy_version(connection: JobConnection) -> int:
    value = connection.redis.get(connection.key("policy_version"))
    return int(value) if value is not None else 0


def _array(data: bytes | None, wire_dtype: str, dtype: type) -> np.ndarray:
    # astype copies, so the Sample owns writable arrays (frombuffer alone would be read-only).
    return np.frombuffer(data or b"", dtype=wire_dtype).astype(dtype)


def decode_sample(
    sample_id: str,
    raw_fields: dict[bytes, bytes],
    tok: bytes | None,
    lp: bytes | None,
    ver: bytes | None,
    mask: bytes | None,
    route: bytes | None = None,
) -> Sample:
    fields = {name.decode(): value for name, value in raw_fields.items()}
    token_rewards = fields.get("token_rewards")
    reward = fields.get("reward")
    failure = fields.get("failure")
    return Sample(
        id=sample_id,
        group_id=fields["group_id"].decode(),
        index=int(fields["index"]),
        prompt_ids=_array(fields["prompt_ids"], WIRE_TOKEN, TOKEN_DTYPE),
        max_new_tokens=int(fields["max_new_tokens"]),
        response_ids=_array(tok, WIRE_TOKEN, TOKEN_DTYPE),
        logprobs=_array(lp, WIRE_LOGPROB, LOGPROB_DTYPE),
        versions=_array(ver, WIRE_VERSION, VERSION_DTYPE),
        loss_mask=_array(mask, WIRE_MASK, MASK_DTYPE),
        # routing replay: [tokens, layers * top_k] expert ids (255: none recorded)
        routing=np.frombuffer(route, dtype=np.uint8).reshape(len(tok) // 4, -1).copy() if route and tok else None,
        status=Status(fields["status"].decode()),
        reward=float(reward) if reward is not None else None,
        token_rewards=_array(token_rewards, WIRE_LOGPROB, np.float32) if token_rewards is not None else None,
        failure=failure.decode() if failure is not None else None,
        metadata=json.loads(fields["metadata"]),
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
    )
