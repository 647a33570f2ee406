"""The durable Redis buffer of one job (docs/architecture.md, "Buffer (Redis)"), in three parts that share one
connection per process (`JobConnection`):

- `store.TrajectoryStore`: trajectories, groups, leases, queues, exactly-once claims (rollout
  workers, learner, driver);
- `telemetry.JobTelemetry`: events, engine health, steps, job info, expert load and the control
  record; the dashboard writes only through it;
- `queries.BufferQueries`: the dashboard's read-only listings and summaries;
- `records.py`: how a trajectory lies in Redis (wire dtypes, decoding), and the reads the store
  and the queries share.

Key layout, all under `slime:<job>:` so jobs sharing a server never see each other (unchanged since
the single-file buffer; tests/test_buffer_compat.py reads a job the old code wrote). On a Redis
Cluster the prefix is `slime:{<job>}:`: the hash tag keeps every key of the job in one slot.

    sample:<sid>                hash: group_id, index, status, prompt_ids (int32 bytes), max_new_tokens,
                                reward, token_rewards (float32 bytes), failure, metadata (JSON),
                                created_at, updated_at, lease_owner, trained_upto (absent fields mean None)
    sample:<sid>:tok|lp|ver|mask  per-token arrays as little-endian int32/float32/int32/int8 bytes,
                                grown with APPEND so a chunk costs O(chunk)
    sample:<sid>:route          routing replay: the tokens' recorded experts, the same bytes per token
    sample:<sid>:env            a multi-turn env's snapshot (JSON) as of the last observation, written in
                                the same script as that observation; deleted when the sample finishes
    group:<gid>                 hash: n, done, status (open|ready|claimed|trained|dropped), metadata,
                                created_at, claimed_step, drop_reason, trained_members, pruned (1: its
                                samples and list were deleted, buffer.keep_trained_steps after training)
    group:<gid>:samples         list of sample ids in index order
    groups                      zset gid -> created_at
    queue:resume / queue:new    lists of sample ids; lease pops resume first (partials before new prompts)
    queue:ready                 list of complete group ids, consumed by claim_groups
    signal:ready                at most one element, pushed when a group turns ready: the driver blocks
                                on it (wait_for_ready_signal) instead of polling
    leases                      zset sid -> lease expiry (Redis server time, seconds)
    claimed / trained           zsets gid -> training step (a streamed group: the time it was trained)
    dropped                     zset gid -> the time it was dropped
    commit_times                zset (server time) -> the step whose checkpoint committed then; the
                                pruning horizon for dropped groups (commit_through.lua)
    stream:untrained            set of sample ids trained segment by segment (streaming mode)
    status_counts               hash status -> number of samples
    stats                       hash name -> float (generated_tokens, dropped_*, restarted_*, pruned_*,
                                pruned_through_step, forgotten_*: groups whose records a long job deleted,
                                buffer.keep_group_records_steps after pruning; the counts add them)
    policy_version              string
    events, control, engines, expert_load, steps, job_info: the telemetry (telemetry.py)

Every state change is one Lua script (lua/), atomic. The scripts build key names from the job
prefix; each call names one key of the job's slot, so on a cluster it runs on the master that holds
the job (connection.py).
"""

from slime.buffer.connection import JOB_NAME_PATTERN, JobConnection, ReplicaAckError, is_cluster_url, open_client
from slime.buffer.queries import BufferQueries
from slime.buffer.store import ChunksLostError, Finish, LeaseLostError, NewGroup, PendingReplies, TrajectoryStore
from slime.buffer.telemetry import JobTelemetry

__all__ = [
    "JOB_NAME_PATTERN",
    "BufferQueries",
    "ChunksLostError",
    "Finish",
    "JobConnection",
    "JobTelemetry",
    "LeaseLostError",
    "NewGroup",
    "PendingReplies",
    "ReplicaAckError",
    "TrajectoryStore",
    "is_cluster_url",
    "open_client",
]
