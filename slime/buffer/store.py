"""The trajectory store: every trajectory, finished or not, its group, lease and queue position
(docs/architecture.md, "Buffer (Redis)"; the key layout is in slime/buffer/__init__.py).

Every state change is one Lua script (slime/buffer/lua/), so it is atomic. Lease times come from the
Redis server's clock (`TIME`), so workers on machines with skewed clocks agree on who has expired.

Longer than 500 lines: one method per buffer operation, each a thin call of its Lua script (the
operations are the buffer's contract, listed in one place); connections, queries, records and
telemetry are files of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from slime.buffer.connection import JobConnection, OnceScript, ScriptBatch, ScriptReply
from slime.buffer.records import (
    WIRE_LOGPROB,
    WIRE_MASK,
    WIRE_TOKEN,
    WIRE_VERSION,
    decode_sample,
    load_samples,
    read_counts,
    read_policy_version,
)
from slime.sample import (
    FINAL_STATUSES,
    TOKEN_DTYPE,
    ChunkLengthError,
    Sample,
    Status,
    new_id,
    normalize_chunk,
)
from slime.security import redact_url

MAX_FAILURE_CHARS = 2000  # a reward that raised with a 100 kB message printed it whole at the end


def clip_failure(failure: str | None) -> str:
    """A failure as stored: its head and tail when it is long (the cause is at one end or the other)."""
    if not failure or len(failure) <= MAX_FAILURE_CHARS:
        return failure or ""
    half = MAX_FAILURE_CHARS // 2
    return f"{failure[:half]} ...[{len(failure) - 2 * half} characters cut]... {failure[-half:]}"


# How long a store remembers its claims, in steps: a claim Redis lost comes back at the next claims.
CLAIM_MEMORY_STEPS = 64
DRAWN_AFTER_CHECKPOINT = "drawn_after_checkpoint"  # the drop reason of a resume (restore_to_checkpoint)


class Restored(NamedTuple):
    """What a resume did to the groups the checkpoint had not trained (restore_to_checkpoint)."""

    dropped: int  # drawn after the checkpoint: the restored sampler draws their prompts again
    retrained: int  # trained by later steps (a resume from an older checkpoint): ready again
    lost: int  # trained by later steps, but pruned or streamed: their update is lost with the weights
    # Records of groups trained after the checkpoint were deleted (buffer.keep_group_records_steps):
    # `lost` cannot count those groups.
    records_forgotten: bool = False

    def describe(self) -> str:
        text = (
            f"{self.dropped} groups drawn after the checkpoint are dropped (their prompts come again), "
            f"{self.retrained} trained after it are ready again, {self.lost} trained after it cannot be"
        )
        if self.records_forgotten:
            text += (
                "; more groups were trained after it, whose records are deleted (buffer.keep_group_records_steps): "
                "their updates are lost too, and not counted here"
            )
        return text


@dataclass
class NewGroup:
    """One group to create, as `TrajectoryStore.add_group` takes it (for `add_groups`)."""

    prompt_ids: np.ndarray | Sequence[int]
    n: int
    max_new_tokens: int
    metadata: dict[str, Any]
    group_id: str | None = None
    draw: int | None = None
    streaming: bool = False


@dataclass
class Finish:
    """One sample's final status, as `TrajectoryStore.finish` takes it (for `finish_many`)."""

    sample_id: str
    status: Status
    reward: float | None = None
    failure: str | None = None
    token_rewards: np.ndarray | Sequence[float] | None = None
    metadata_update: dict[str, Any] | None = None
    # The sample's metadata as stored, when the caller has it: the lease holder does (only it and
    # add_group write a sample's metadata), so it need not be read back to merge the update into.
    stored_metadata: dict[str, Any] | None = None
    # The response length the writer knows is stored: fewer stored tokens raise ChunksLostError.
    stored_length: int | None = None


class LeaseLostError(RuntimeError):
    """The caller no longer holds the lease on this sample (it expired and was requeued, or finished)."""


class SampleGoneError(LeaseLostError, KeyError):
    """The sample is no longer in the buffer: its group was trained and pruned
    (buffer.keep_trained_steps) after this writer lost its lease, or the job was deleted. To a
    writer it is a lost lease; to a reader, a missing key."""


class ChunksLostError(RuntimeError):
    """The stored trajectory is shorter than the writer knows it to be: Redis lost its last writes
    (a crash of the machine within the AOF's unsynced second). What is stored is a token-exact
    prefix; the writer releases the sample and it is resumed from there."""

    def __init__(self, message: str, stored_length: int) -> None:
        super().__init__(message)
        self.stored_length = stored_length


# One chunk for `append_chunks`: sample id, token ids, logprobs, versions, stored length (or None).
# sample id, token ids, logprobs, versions, stored length (or None), and optionally the tokens'
# recorded experts (routing replay: layers x top_k bytes per token, or None)
ChunkWrite = (
    tuple[str, Sequence[int], Sequence[float], Sequence[int], int | None]
    | tuple[str, Sequence[int], Sequence[float], Sequence[int], int | None, bytes | None]
)


def _float_text(value: float) -> str:
    return repr(float(value))


class TrajectoryStore:
    """Trajectories, groups, leases, queues and exactly-once claims of one job in one Redis server."""

    def __init__(self, connection: JobConnection, lease_seconds: float = 10.0) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.connection = connection
        self.lease_seconds = float(lease_seconds)
        self.url, self.job, self.prefix = connection.url, connection.job, connection.prefix
        self.redis = connection.redis
        self._key = connection.key
        self._add_group = connection.once_script("add_group.lua")
        self._lease = connection.once_script("transitions.lua", "lease.lua")
        # The append checks the writer's stored length, so a resent chunk is recognised there.
        self._append = connection.once_script("transitions.lua", "append.lua", stores_reply=False)
        self._renew = connection.once_script("transitions.lua", "renew.lua")
        self._finish = connection.once_script("transitions.lua", "finish.lua")
        self._release = connection.once_script("transitions.lua", "release.lua")
        self._reap = connection.once_script("transitions.lua", "reap.lua")
        self._claim = connection.once_script("claim.lua")
        self._claim_in_order = connection.once_script("claim_in_order.lua")
        self._reclaim = connection.once_script("reclaim.lua")
        # This store's claims of the last CLAIM_MEMORY_STEPS steps: group id -> step, and per
        # streamed trajectory ("sample id:restarts") -> (step, tokens trained, final claimed). A claim Redis lost at a crash comes back as ready (or as
        # untrained tokens) and is claimed again; these say it was trained already.
        self._claimed_steps: dict[str, int] = {}
        self._claimed_segments: dict[str, tuple[int, int, bool]] = {}
        # The dry run only reads (and moves a cursor): polled often, so no reply is stored.
        self._count_in_order = connection.once_script("claim_in_order.lua", stores_reply=False)
        self._commit = connection.once_script("commit.lua")
        self._commit_through = connection.once_script("commit_through.lua")
        self._requeue = connection.once_script("transitions.lua", "requeue.lua")
        self._retrain_after = connection.once_script("transitions.lua", "retrain_after.lua")
        self._drop_ready = connection.once_script("transitions.lua", "drop_ready.lua")
        self._drop_claimed = connection.once_script("transitions.lua", "drop_claimed.lua")
        self._drop_drawn_after = connection.once_script("transitions.lua", "drawn.lua", "drop_drawn_after.lua")
        self._drawn_after = connection.script("drawn.lua", "drawn_after.lua")
        self._restart = connection.once_script("transitions.lua", "restart.lua")
        self._requeue_leased = connection.once_script("transitions.lua", "requeue_leased.lua")
        self._claim_segments = connection.once_script("claim_segments.lua")
        self._set_rewards = connection.once_script("transitions.lua", "set_rewards.lua")

    @classmethod
    def open(cls, url: str, job: str, lease_seconds: float = 10.0, *, password: str | None = None) -> TrajectoryStore:
        """A store on a connection of its own (see `JobConnection` for ``password``)."""
        return cls(JobConnection(url, job, password=password), lease_seconds)

    # Pickled (Ray actor arguments): the copy opens its own connection, password kept.
    def __reduce__(self) -> tuple:
        return (TrajectoryStore, (self.connection, self.lease_seconds))

    def __repr__(self) -> str:
        return f"TrajectoryStore(job={self.job!r}, url={redact_url(self.url)!r})"

    def close(self) -> None:
        self.connection.close()

    # ---- writes -------------------------------------------------------------------------------

    def add_group(
        self,
        prompt_ids: np.ndarray | Sequence[int],
        n: int,
        max_new_tokens: int,
        metadata: dict[str, Any],
        group_id: str | None = None,
        draw: int | None = None,
        streaming: bool = False,
    ) -> str:
        """Create a group of n PENDING samples of one prompt, queued on `new`. Returns the group id.
        `draw`: how many prompts the job's sampler had drawn with this one (drop_drawn_after).
        `streaming`: its samples are trained segment by segment (claim_segments)."""
        return self.add_groups([NewGroup(prompt_ids, n, max_new_tokens, metadata, group_id, draw, streaming)])[0]

    def add_groups(self, groups: Sequence[NewGroup]) -> list[str]:
        """`add_group` for many groups in one round trip, in order; their ids. An idle worker that
        the first group wakes finds them all: added one by one, it leased the first and started
        decoding it while the others waited for its next look at the queue (20 ms)."""
        ids, calls = [], []
        for group in groups:
            if group.n < 1:
                raise ValueError(f"a group needs n >= 1 samples, got {group.n}")
            if group.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {group.max_new_tokens}")
            group_id = group.group_id or new_id()
            prompt = np.asarray(group.prompt_ids, dtype=TOKEN_DTYPE).reshape(-1).astype(WIRE_TOKEN).tobytes()
            ids.append(group_id)
            calls.append(
                [
                    self.prefix,
                    group_id,
                    group.n,
                    int(group.max_new_tokens),
                    prompt,
                    json.dumps(group.metadata),
                    "" if group.draw is None else int(group.draw),
                    "1" if group.streaming else "",
                    *(new_id() for _ in range(group.n)),
                ]
            )
        for group_id, created in zip(ids, ScriptBatch(self._add_group, calls).replies()):
            if not created:
                raise ValueError(f"group {group_id!r} already exists in job {self.job!r}")
        return ids

    def lease(self, worker_id: str, max_items: int) -> list[Sample]:
        """Lease up to max_items samples, resume queue first, then new prompts; they become RUNNING."""
        if max_items <= 0:
            return []
        leased = self._lease(args=[self.prefix, worker_id, int(max_items), self.lease_seconds])
        return [
            decode_sample(sid.decode(), dict(zip(flat[::2], flat[1::2])), tok, lp, ver, mask)
            for sid, flat, tok, lp, ver, mask in leased
        ]

    def append_chunk(
        self,
        sample_id: str,
        worker_id: str,
        token_ids: np.ndarray | Sequence[int],
        logprobs: np.ndarray | Sequence[float],
        version: int | np.ndarray | Sequence[int],
        loss_mask: int | np.ndarray | Sequence[int] = 1,
        stored_length: int | None = None,
        routing: bytes | None = None,
        env_state: str | None = None,
    ) -> int:
        """Append one chunk to the four per-token arrays and refresh the lease. Returns the new length.
        ``stored_length``: the length the caller knows is stored; a shorter stored trajectory raises
        ChunksLostError instead of appending after a gap, and a resend of a chunk already applied
        (its reply lost to a Redis restart) changes nothing. Without it neither is checked.
        ``routing``: the tokens' recorded experts, the same number of bytes per token (routing
        replay); a trajectory's tokens without any (an environment's) read as none recorded.
        ``env_state``: a multi-turn env's snapshot (JSON) as it stands after this chunk, stored in the
        same atomic step (`env_state`)."""
        tokens, lps, versions, mask = normalize_chunk(token_ids, logprobs, version, loss_mask)
        args = self._append_args(sample_id, worker_id, tokens, lps, versions, mask, stored_length, routing)
        if env_state is not None:
            args.append(env_state)
        code, detail = self._append(args=args)
        self._raise_for(code, detail, sample_id, worker_id)
        return int(detail)

    def _append_args(
        self, sample_id: str, worker_id: str, tokens, lps, versions, mask, stored_length, routing=None
    ) -> list:
        """The append script's arguments: the four per-token arrays in their wire dtypes."""
        if routing is not None and (len(tokens) == 0 or len(routing) % len(tokens)):
            raise ValueError(f"routing: {len(routing)} bytes do not divide into {len(tokens)} tokens")
        return [
            self.prefix,
            sample_id,
            worker_id,
            self.lease_seconds,
            tokens.astype(WIRE_TOKEN).tobytes(),
            lps.astype(WIRE_LOGPROB).tobytes(),
            versions.astype(WIRE_VERSION).tobytes(),
            mask.astype(WIRE_MASK).tobytes(),
            "" if stored_length is None else int(stored_length),
            routing or b"",
        ]

    def append_chunks(self, worker_id: str, chunks: Sequence[ChunkWrite]) -> list[int | Exception]:
        """Many `append_chunk`s (sample_id, token_ids, logprobs, versions, stored_length or None;
        loss mask 1) in one round trip; each stays atomic on its own. Per chunk: the new length, or
        the error it raised."""
        return self.send_append_chunks(worker_id, chunks).wait()

    def send_append_chunks(self, worker_id: str, chunks: Sequence[ChunkWrite]) -> PendingReplies:
        """`append_chunks`, sent now; its replies are read by ``.wait()``. The rollout thread runs an
        engine step in between, while Redis executes the scripts (on another core)."""
        calls = []
        for sample_id, token_ids, logprobs, versions, stored_length, *routing in chunks:
            tokens, lps, vers, mask = normalize_chunk(token_ids, logprobs, versions, 1)
            route = routing[0] if routing else None
            calls.append(self._append_args(sample_id, worker_id, tokens, lps, vers, mask, stored_length, route))
        return PendingReplies(self, self._append, calls, int)

    def renew_leases(self, worker_id: str, sample_ids: Sequence[str]) -> list[str]:
        """Extend the leases worker_id still holds; returns the ids it no longer owns."""
        if not sample_ids:
            return []
        lost = self._renew(args=[self.prefix, worker_id, self.lease_seconds, *sample_ids])
        return [sid.decode() for sid in lost]

    def finish(
        self,
        sample_id: str,
        worker_id: str,
        status: Status,
        reward: float | None = None,
        failure: str | None = None,
        token_rewards: np.ndarray | Sequence[float] | None = None,
        metadata_update: dict[str, Any] | None = None,
    ) -> bool:
        """Give a leased sample its final status; True when this completed its group (group now ready)."""
        result = self.finish_many(
            worker_id, [Finish(sample_id, status, reward, failure, token_rewards, metadata_update)]
        )[0]
        if isinstance(result, Exception):
            raise result
        return result

    def finish_many(self, worker_id: str, finishes: Sequence[Finish]) -> list[bool | Exception]:
        """`finish` for many samples in one round trip (one more to read the stored metadata that a
        metadata update merges into, unless the caller gives it); per sample whether it completed
        its group, or the error it raised."""
        return self.send_finish_many(worker_id, finishes).wait()

    def send_finish_many(self, worker_id: str, finishes: Sequence[Finish]) -> PendingReplies:
        """`finish_many`, sent now; ``.wait()`` reads its replies (see `send_append_chunks`)."""
        statuses = [Status(f.status) for f in finishes]
        for status in statuses:
            if status not in FINAL_STATUSES:
                finals = ", ".join(sorted(s.value for s in FINAL_STATUSES))
                raise ValueError(f"finish needs a final status ({finals}), got {status.value}")
        # Only the lease holder writes a sample's metadata, and the script rejects a lost lease, so
        # reading, merging here and writing in the script cannot drop another writer's update.
        metadata_json = {
            id(f): json.dumps({**f.stored_metadata, **f.metadata_update})
            for f in finishes
            if f.metadata_update and f.stored_metadata is not None
        }
        merging = [f for f in finishes if f.metadata_update and f.stored_metadata is None]
        if merging:
            pipe = self.connection.pipeline(transaction=False)
            for f in merging:
                pipe.hget(self._key("sample", f.sample_id), "metadata")
            for f, stored in zip(merging, pipe.execute()):
                merged = json.loads(stored) if stored else {}
                merged.update(f.metadata_update)
                metadata_json[id(f)] = json.dumps(merged)
        calls = []
        for f, status in zip(finishes, statuses):
            token_reward_bytes = b""
            if f.token_rewards is not None:
                token_reward_bytes = np.asarray(f.token_rewards, dtype=WIRE_LOGPROB).reshape(-1).tobytes()
            calls.append(
                [
                    self.prefix,
                    f.sample_id,
                    worker_id,
                    status.value,
                    "" if f.reward is None else _float_text(f.reward),
                    clip_failure(f.failure),
                    "0" if f.token_rewards is None else "1",
                    token_reward_bytes,
                    metadata_json.get(id(f), ""),
                    "" if f.stored_length is None else int(f.stored_length),
                ]
            )
        return PendingReplies(self, self._finish, calls, bool)

    def release(self, sample_id: str, worker_id: str) -> None:
        """Abort a leased sample: ABORTED, tokens kept, lease released, first in the resume queue."""
        error = self.release_many([sample_id], worker_id)[0]
        if error is not None:
            raise error

    def release_many(self, sample_ids: Sequence[str], worker_id: str) -> list[Exception | None]:
        """`release` for many samples in one round trip, in order (the last released is first in
        the resume queue); per sample None, or the error it raised."""
        calls = [[self.prefix, sample_id, worker_id] for sample_id in sample_ids]
        return [r if isinstance(r, Exception) else None for r in self._run_per_sample(self._release, calls, bool)]

    def reap_expired_leases(self) -> list[str]:
        """Requeue (ABORTED, tokens kept, front of resume) every sample whose lease expired."""
        return [sid.decode() for sid in self._reap(args=[self.prefix])]

    def claim_groups(self, max_groups: int, step: int, in_start_order: bool = False) -> list[list[Sample]]:
        """Pop up to max_groups complete groups for training `step`; each group's samples by index.
        In the order they became ready; with ``in_start_order`` (async), the ready groups at the head
        of the line of groups waiting for training, oldest started first (claim_in_order.lua)."""
        if max_groups <= 0:
            return []
        fresh: list[str] = []
        while len(fresh) < max_groups:
            want = max_groups - len(fresh)
            if in_start_order:
                claimed = self._claim_in_order(args=[self.prefix, want, int(step), ""])
            else:
                claimed = self._claim(args=[self.prefix, want, int(step)])
            gids = [gid.decode() for gid in claimed]
            again = {gid: self._claimed_steps[gid] for gid in gids if self._claimed_steps.get(gid, step) < step}
            if not again:
                fresh += gids
                break
            self._reclaim(args=[self.prefix, *(x for pair in again.items() for x in pair)])
            fresh += [gid for gid in gids if gid not in again]
        self._claimed_steps.update(dict.fromkeys(fresh, step))
        self._forget_claims(step)
        return self.get_groups(fresh)

    def _forget_claims(self, step: int) -> None:
        if len(self._claimed_steps) + len(self._claimed_segments) > 4096:
            oldest = step - CLAIM_MEMORY_STEPS
            self._claimed_steps = {g: s for g, s in self._claimed_steps.items() if s >= oldest}
            self._claimed_segments = {k: v for k, v in self._claimed_segments.items() if v[0] >= oldest}

    def ready_in_start_order(self, max_groups: int) -> int:
        """How many of the oldest groups waiting for training are ready, in a row (at most max_groups):
        what an in-order claim would take now."""
        return int(self._count_in_order(args=[self.prefix, int(max_groups), 0, "1"]))

    def commit_step(self, step: int) -> int:
        """Mark the groups claimed by `step` as trained. Returns how many."""
        return int(self._commit(args=[self.prefix, int(step)]))

    def commit_through(
        self,
        step: int,
        keep_trained_steps: int | None = None,
        keep_group_records_steps: int | None = None,
        prune_batch: int = 256,
    ) -> int:
        """Mark every group claimed by a step <= `step` as trained. Returns how many. With
        ``keep_trained_steps``, delete the trajectories of groups trained at a step <= step -
        keep_trained_steps, and of groups dropped before that step's checkpoint (their group
        records stay; stats count them as pruned_*), `prune_batch` groups per script call so that
        no call holds the server long. With ``keep_group_records_steps`` too, the records of pruned
        groups that far back go as well (the group counts keep counting them: stats forgotten_*)."""
        keep = "" if keep_trained_steps is None else int(keep_trained_steps)
        records = ""
        if keep_trained_steps is not None and keep_group_records_steps is not None:
            records = max(int(keep_group_records_steps), int(keep_trained_steps))
        args = [self.prefix, int(step), keep, int(prune_batch)]
        committed, offset = (int(x) for x in self._commit_through(args=[*args, 0, "1", records]))
        while offset >= 0:
            offset = int(self._commit_through(args=[*args, offset, "", records])[1])
        return committed

    def requeue_uncommitted(self, after_step: int | None = None) -> int:
        """Put claimed-but-uncommitted groups (claimed by a step > after_step; all if None) back to ready."""
        self._claimed_steps = {
            g: s for g, s in self._claimed_steps.items() if after_step is not None and s <= after_step
        }
        return int(self._requeue(args=[self.prefix, "" if after_step is None else int(after_step)]))

    def wait_for_ready_signal(self, timeout_s: float) -> bool:
        """Block until a group turned ready since the last call (True), or ``timeout_s`` passed."""
        return self.redis.blpop([self._key("signal", "ready")], timeout=timeout_s) is not None

    def wait_for_work_signal(self, timeout_s: float) -> bool:
        """An idle worker's wait: until groups were added since the signal was last taken (True), or
        ``timeout_s`` passed. One signal wakes one waiter; other idle workers find the work at their
        timeout."""
        return self.redis.blpop([self._key("signal", "work")], timeout=timeout_s) is not None

    def ready_group_ids(self) -> list[str]:
        return [gid.decode() for gid in self.redis.lrange(self._key("queue", "ready"), 0, -1)]

    def drop_claimed_group(self, group_id: str, reason: str) -> bool:
        """Take a claimed, not yet committed group out of training for good (e.g. beyond the learner's
        staleness bound), so the step's commit does not count it trained; counted in stats as
        dropped_groups:<reason> and dropped_tokens:<reason>."""
        return bool(self._drop_claimed(args=[self.prefix, group_id, reason]))

    def restore_to_checkpoint(
        self,
        next_step: int,
        draws: int,
        keep_trained_steps: int | None,
        keep_group_records_steps: int | None = None,
    ) -> Restored:
        """A job resumed from the checkpoint taken before `next_step`: claims of steps inside it are
        trained (the process may have died before it marked them); groups drawn after the sampler's
        first `draws` prompts (the checkpoint's, or as far as fast_forward took it) are dropped, since
        the sampler draws them again; claims of later steps, and groups later checkpoints committed
        (a resume from an older one), go back to the ready queue, to train on the checkpoint's weights."""
        self.commit_through(next_step - 1, keep_trained_steps, keep_group_records_steps)
        dropped = self.drop_drawn_after(draws, DRAWN_AFTER_CHECKPOINT)[0]
        self.requeue_uncommitted()
        retrained, lost = (int(x) for x in self._retrain_after(args=[self.prefix, int(next_step)]))
        forgotten_through = self.stats().get("forgotten_through_step", -1.0)
        return Restored(dropped, retrained, lost, next_step <= forgotten_through)

    def groups_drawn_after(self, draws: int) -> dict[int, tuple[int | None, str]]:
        """draw -> (its prompt's record_index, or None where unknown; its status) of every group the
        sampler drew after its first `draws` prompts (a resume's view of what the checkpoint did not
        see)."""
        flat = self._drawn_after(args=[self.prefix, int(draws)])
        out: dict[int, tuple[int | None, str]] = {}
        for draw, status, index in zip(flat[::3], flat[1::3], flat[2::3]):  # newest first: it wins a draw
            out.setdefault(int(draw), (int(float(index)) if index else None, status.decode()))
        return out

    def drop_drawn_after(self, draws: int, reason: str) -> tuple[int, int]:
        """Drop every group the sampler drew after its first `draws` prompts, whatever its state (a
        resume restores the sampler of a checkpoint, which draws those prompts again). Returns
        (groups dropped, their tokens); groups added without a draw count are kept."""
        groups, tokens = self._drop_drawn_after(args=[self.prefix, int(draws), reason])
        return int(groups), int(tokens)

    def drop_ready_group(self, group_id: str, reason: str) -> bool:
        """Take a complete group out of the ready queue for good (e.g. a dynamic-sampling filter);
        counted in stats as dropped_groups:<reason> and dropped_tokens:<reason>."""
        return bool(self._drop_ready(args=[self.prefix, group_id, reason]))

    def set_rewards(self, scores: Sequence[tuple[str, float | None, str | None, dict | None, Status | None]]) -> int:
        """(sample id, reward, failure, metadata, status) of finished samples: reward.scope=group's
        scores, written when the learner takes their group (again, if a requeued claim is scored
        again). A reward clears an earlier failure and a failure an earlier reward. Returns how
        many of the samples exist."""
        if not scores:
            return 0
        args: list[Any] = [self.prefix]
        for sid, reward, failure, metadata, status in scores:
            meta = json.dumps(metadata) if metadata is not None else ""
            reward_arg = "" if reward is None else repr(float(reward))
            args += [sid, reward_arg, clip_failure(failure), meta, status.value if status is not None else ""]
        return int(self._set_rewards(args=args))

    def restart_sample(self, sample_id: str, worker_id: str) -> int:
        """Discard a leased sample's tokens so it is generated afresh; returns how many were discarded
        (counted in stats as restarted_tokens)."""
        code, detail = self._restart(args=[self.prefix, sample_id, worker_id])
        self._raise_for(code, detail, sample_id, worker_id)
        return int(detail)

    def requeue_all_leased(self) -> int:
        """Every RUNNING sample back to the resume queue, tokens kept: for a job restarted after its
        workers died, without waiting for their leases to expire."""
        return int(self._requeue_leased(args=[self.prefix]))

    def count_segments(self, chunk_tokens: int, step: int) -> int:
        """How many segments claim_segments would take now; groups whose last members finished with
        no tokens become trained at ``step``."""
        return int(self._claim_segments(args=[self.prefix, int(chunk_tokens), 1 << 30, "1", int(step)]))

    def claim_segments(self, chunk_tokens: int, max_segments: int, step: int) -> list[tuple[Sample, int, bool]]:
        """Atomically take up to max_segments trainable segments of training step ``step``: (sample as
        stored now, start, final). The sample's tokens [start, response_length) are the segment; each
        token is claimed once."""
        flat = self._claim_segments(args=[self.prefix, int(chunk_tokens), int(max_segments), "0", int(step)])
        out = []
        for i in range(0, len(flat), 5):
            sid, start, end, final = flat[i].decode(), int(flat[i + 1]), int(flat[i + 2]), flat[i + 3] == b"1"
            key = f"{sid}:{int(flat[i + 4])}"  # a restarted trajectory (restart_sample) is a new one
            _, trained, trained_final = self._claimed_segments.get(key, (step, 0, False))
            self._claimed_segments[key] = (step, max(end, trained), final or trained_final)
            if trained > start:  # this store trained [start, trained) already: a claim Redis lost
                if trained_final or (trained >= end and not final):
                    continue
                start = min(trained, end - 1)  # a final segment's last token carries the reward
            sample = self.get_sample(sid)
            # A worker may have appended more since the claim: the segment ends where the claim did.
            sample.response_ids, sample.logprobs = sample.response_ids[:end], sample.logprobs[:end]
            sample.versions, sample.loss_mask = sample.versions[:end], sample.loss_mask[:end]
            out.append((sample, start, final))
        self._forget_claims(step)
        return out

    def incr_stat(self, name: str, amount: float = 1.0) -> float:
        return float(self.redis.hincrbyfloat(self._key("stats"), name, amount))

    def set_policy_version(self, version: int) -> None:
        self.redis.set(self._key("policy_version"), int(version))

    def delete_job(self) -> int:
        """Delete every key of this job (and only this job), but the live run's claim on the job name
        (buffer/owner.py). Returns how many keys were removed."""
        removed = 0
        batch: list[bytes] = []
        owner = self._key("owner").encode()
        # Every key of the job lies on one server (on a cluster: its slot's master).
        for key in self.connection.node_client().scan_iter(match=self.prefix + "*", count=1000):
            if key == owner:
                continue
            batch.append(key)
            if len(batch) >= 1000:
                removed += self.redis.unlink(*batch)
                batch = []
        if batch:
            removed += self.redis.unlink(*batch)
        return removed

    # ---- reads --------------------------------------------------------------------------------

    def env_state(self, sample_id: str) -> str | None:
        """The env snapshot last stored with an observation of this unfinished sample (None: none)."""
        raw = self.redis.get(self._key("sample", sample_id, "env"))
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else raw

    def get_sample(self, sample_id: str) -> Sample:
        samples = load_samples(self.connection, [sample_id])
        if not samples:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        return samples[0]

    def get_group(self, group_id: str) -> list[Sample]:
        return self.get_groups([group_id])[0]

    def groups_trained_at(self, step: int) -> list[str]:
        """The groups training step ``step`` took (trained, or claimed and not yet committed), in the
        order the learner claimed them (`slime replay`)."""
        gids = [
            gid.decode()
            for zset in ("trained", "claimed")
            for gid in self.redis.zrangebyscore(self._key(zset), step, step)
        ]
        pipe = self.connection.pipeline(transaction=False)
        for gid in gids:
            pipe.hmget(self._key("group", gid), "claim_seq", "created_at", "trained_members")
        fields = pipe.execute() if gids else []
        order = {gid: (float(seq or 0), float(created or 0)) for gid, (seq, created, _) in zip(gids, fields)}
        # Streamed groups (trained_members) trained segment by segment over several steps: not a batch.
        return sorted((g for g, f in zip(gids, fields) if f[2] is None), key=order.__getitem__)

    def get_groups(self, group_ids: Sequence[str]) -> list[list[Sample]]:
        """Several groups, each by index: their sample lists in one round trip, then the samples in
        MULTI/EXECs of at most 256 (each sample a consistent snapshot; no one reply holds a whole
        large batch)."""
        pipe = self.connection.pipeline(transaction=False)
        for gid in group_ids:
            pipe.lrange(self._key("group", gid, "samples"), 0, -1)
        lists = [[sid.decode() for sid in ids] for ids in pipe.execute()] if group_ids else []
        for gid, ids in zip(group_ids, lists):
            if not ids:
                raise KeyError(
                    f"group {gid!r} not found in job {self.job!r} (a trained group's trajectories are deleted "
                    "buffer.keep_trained_steps steps after its checkpoint)"
                )
        every = [sid for ids in lists for sid in ids]
        loaded = {s.id: s for i in range(0, len(every), 256) for s in load_samples(self.connection, every[i : i + 256])}
        return [sorted((loaded[sid] for sid in ids if sid in loaded), key=lambda s: s.index) for ids in lists]

    def counts(self) -> dict[str, int]:
        """Samples by status, queue lengths, groups by stage and running leases (all O(1) reads)."""
        return read_counts(self.connection)

    def stats(self) -> dict[str, float]:
        return {name.decode(): float(value) for name, value in self.redis.hgetall(self._key("stats")).items()}

    def get_policy_version(self) -> int:
        return read_policy_version(self.connection)

    def running_ids(self) -> list[str]:
        return [sid.decode() for sid in self.redis.zrange(self._key("leases"), 0, -1)]

    def iter_samples(self, status: Status | None = None, batch_size: int = 256) -> Iterator[Sample]:
        """Every sample of the job (SCAN order), optionally only one status. For dashboards and tests."""
        wanted = Status(status) if status is not None else None
        head = self._key("sample", "")
        batch: list[str] = []
        # The per-token arrays share the `sample:` prefix but are strings; TYPE keeps only the hashes.
        for key in self.connection.node_client().scan_iter(match=head + "*", count=1000, _type="hash"):
            batch.append(key.decode()[len(head) :])
            if len(batch) >= batch_size:
                yield from (s for s in load_samples(self.connection, batch) if wanted is None or s.status == wanted)
                batch = []
        if batch:
            yield from (s for s in load_samples(self.connection, batch) if wanted is None or s.status == wanted)

    # ---- internals ----------------------------------------------------------------------------

    def _run_per_sample(
        self, script: OnceScript, calls: Sequence[Sequence[Any]], value: Callable[[Any], Any]
    ) -> list[Any]:
        """A per-sample script (ARGV: prefix, sample id, worker, ...; reply {code, detail}) over many
        argument lists in one round trip: per call value(detail), or the error its code stands for."""
        return PendingReplies(self, script, list(calls), value).wait()

    def _raise_for(self, code: int, detail: bytes | int, sample_id: str, worker_id: str) -> None:
        if code == ScriptReply.OK:
            return
        text = detail.decode() if isinstance(detail, bytes) else str(detail)
        if code == ScriptReply.LEASE_LOST:
            raise LeaseLostError(
                f"job {self.job!r}: worker {worker_id!r} no longer holds the lease on sample {sample_id!r} "
                f"(lease owner now: {text or 'none'})"
            )
        if code == ScriptReply.NO_SAMPLE:
            raise SampleGoneError(
                f"sample {sample_id!r} not found in job {self.job!r} (trained and pruned, or the job was deleted)"
            )
        if code == ScriptReply.LOST_CHUNKS:
            stored, expected = (int(x) for x in text.split(":"))
            if stored > expected:
                raise RuntimeError(
                    f"job {self.job!r}: sample {sample_id!r} has {stored} tokens stored, more than the {expected} "
                    f"worker {worker_id!r} knows of: another writer appended to it"
                )
            raise ChunksLostError(
                f"job {self.job!r}: sample {sample_id!r} has {stored} tokens stored, {expected} were "
                f"acknowledged to worker {worker_id!r}: Redis lost its last writes",
                stored,
            )
        if code in (ScriptReply.BAD_CHUNK, ScriptReply.STORED_MISMATCH):
            raise ChunkLengthError(f"sample {sample_id!r}: per-token arrays would differ in length ({text})")
        raise RuntimeError(f"sample {sample_id!r}: unexpected buffer script reply {code}: {text}")


class PendingReplies:
    """Per-sample scripts sent now in one pipeline (`ScriptBatch`, slime/buffer/connection.py: resent
    on a lost connection, a moved slot or a missing script), replies not read yet. ``wait()`` reads
    them (once): per call value(detail), or the error its code stands for."""

    def __init__(self, store: TrajectoryStore, script: OnceScript, calls: list[list[Any]], value: Callable[[Any], Any]):
        self.store, self.calls, self.value = store, calls, value
        self.batch = ScriptBatch(script, calls)
        self.results: list[Any] | None = None

    def wait(self) -> list[Any]:
        if self.results is not None:
            return self.results
        results: list[Any] = []
        for args, (code, detail) in zip(self.calls, self.batch.replies()):
            try:
                self.store._raise_for(code, detail, args[1], args[2])
                results.append(self.value(detail))
            except (LeaseLostError, ChunksLostError, KeyError, ChunkLengthError, RuntimeError) as exc:
                results.append(exc)
        self.results = results
        return results
