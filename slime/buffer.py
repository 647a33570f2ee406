"""The durable store of every trajectory, finished or not (DESIGN.md, "Buffer (Redis)").

Key layout, all under `slime:<job>:` so jobs sharing a server never see each other:

    sample:<sid>                hash: group_id, index, status, prompt_ids (int32 bytes), max_new_tokens,
                                reward, token_rewards (float32 bytes), failure, metadata (JSON),
                                created_at, updated_at, lease_owner (absent fields mean None)
    sample:<sid>:tok|lp|ver|mask  per-token arrays as little-endian int32/float32/int32/int8 bytes,
                                grown with APPEND so a chunk costs O(chunk)
    group:<gid>                 hash: n, done, status (open|ready|claimed|trained), metadata, created_at,
                                claimed_step
    group:<gid>:samples         list of sample ids in index order
    groups                      zset gid -> created_at
    queue:resume / queue:new    lists of sample ids; lease pops resume first (partials before new prompts)
    queue:ready                 list of complete group ids, consumed by claim_groups
    signal:ready                at most one element, pushed when a group turns ready: the driver blocks
                                on it (wait_for_ready_signal) instead of polling
    leases                      zset sid -> lease expiry (Redis server time, seconds)
    claimed / trained           zsets gid -> training step
    status_counts               hash status -> number of samples
    stats                       hash name -> float (generated_tokens, ...)
    policy_version              string

Every state change is one Lua script, so it is atomic. Lease times come from the Redis server's
clock (`TIME`), so workers on machines with skewed clocks agree on who has expired. The scripts
build key names from the job prefix, so they need a standalone (or Sentinel) Redis, not Cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from slime.sample import (
    FINAL_STATUSES,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    ChunkLengthError,
    Sample,
    Status,
    new_id,
    normalize_chunk,
)
from slime.security import redact_url

# On-the-wire dtypes: fixed little-endian so any host reads what any other wrote.
WIRE_TOKEN = "<i4"
WIRE_LOGPROB = "<f4"
WIRE_VERSION = "<i4"
WIRE_MASK = "i1"

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")

# Codes the scripts return as the first element of their reply.
_OK, _LEASE_LOST, _BAD_CHUNK, _STORED_MISMATCH, _NO_SAMPLE = 0, -1, -2, -3, -4


@dataclass
class Finish:
    """One sample's final status, as `RedisBuffer.finish` takes it (for `finish_many`)."""

    sample_id: str
    status: Status
    reward: float | None = None
    failure: str | None = None
    token_rewards: np.ndarray | Sequence[float] | None = None
    metadata_update: dict[str, Any] | None = None
    # The sample's metadata as stored, when the caller has it: the lease holder does (only it and
    # add_group write a sample's metadata), so it need not be read back to merge the update into.
    stored_metadata: dict[str, Any] | None = None


class LeaseLostError(RuntimeError):
    """The caller no longer holds the lease on this sample (it expired and was requeued, or finished)."""


# ARGV[1] is always the job prefix.
_PRELUDE = """
local P = ARGV[1]
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
local function move_count(from, to)
  redis.call('HINCRBY', P .. 'status_counts', from, -1)
  redis.call('HINCRBY', P .. 'status_counts', to, 1)
end
-- A RUNNING sample goes back to the front of the resume queue, ABORTED, its tokens kept.
local function requeue_running(sid)
  local skey = P .. 'sample:' .. sid
  redis.call('HSET', skey, 'status', 'aborted', 'updated_at', fmt(now()))
  redis.call('HDEL', skey, 'lease_owner')
  redis.call('ZREM', P .. 'leases', sid)
  move_count('running', 'aborted')
  redis.call('LPUSH', P .. 'queue:resume', sid)
end
-- One more member of group `gid` is final; true when that completes the open group, which then
-- joins the ready queue and signals the driver (signal:ready holds at most one element).
local function member_done(gid)
  local gkey = P .. 'group:' .. gid
  local done = redis.call('HINCRBY', gkey, 'done', 1)
  if done < tonumber(redis.call('HGET', gkey, 'n')) or redis.call('HGET', gkey, 'status') ~= 'open' then
    return false
  end
  redis.call('HSET', gkey, 'status', 'ready')
  redis.call('RPUSH', P .. 'queue:ready', gid)
  redis.call('RPUSH', P .. 'signal:ready', '1')
  redis.call('LTRIM', P .. 'signal:ready', -1, -1)
  return true
end
-- nil when `worker` holds the lease on `sid`, else the current owner ('' for none)
local function lost_lease(sid, worker)
  local owner = redis.call('HGET', P .. 'sample:' .. sid, 'lease_owner')
  if owner == worker and redis.call('ZSCORE', P .. 'leases', sid) then return nil end
  return owner or ''
end
"""

# ARGV: prefix, gid, n, max_new_tokens, prompt bytes, metadata json, sample ids (n of them)
_ADD_GROUP = """
local gid, n = ARGV[2], tonumber(ARGV[3])
local gkey = P .. 'group:' .. gid
if redis.call('EXISTS', gkey) == 1 then return 0 end
local t = fmt(now())
redis.call('HSET', gkey, 'n', n, 'done', 0, 'status', 'open', 'created_at', t, 'metadata', ARGV[6])
redis.call('ZADD', P .. 'groups', t, gid)
for i = 1, n do
  local sid = ARGV[6 + i]
  redis.call('HSET', P .. 'sample:' .. sid, 'group_id', gid, 'index', i - 1, 'status', 'pending',
    'prompt_ids', ARGV[5], 'max_new_tokens', ARGV[4], 'metadata', ARGV[6], 'created_at', t, 'updated_at', t)
  redis.call('RPUSH', gkey .. ':samples', sid)
  redis.call('RPUSH', P .. 'queue:new', sid)
end
redis.call('HINCRBY', P .. 'status_counts', 'pending', n)
return 1
"""

# ARGV: prefix, worker, max_items, lease_seconds. Returns, per leased sample, {sid, its hash as a
# flat list, tok, lp, ver, mask}: leased and read in one round trip, a consistent snapshot.
_LEASE = """
local worker, max_items, lease_s = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = now()
local leased = {}
for _, queue in ipairs({'queue:resume', 'queue:new'}) do
  while #leased < max_items do
    local sid = redis.call('LPOP', P .. queue)
    if not sid then break end
    local skey = P .. 'sample:' .. sid
    local status = redis.call('HGET', skey, 'status')
    -- anything else is a stale entry (sample deleted or already leased): drop it
    if status == 'pending' or status == 'aborted' then
      redis.call('HSET', skey, 'status', 'running', 'lease_owner', worker, 'updated_at', fmt(t))
      redis.call('ZADD', P .. 'leases', fmt(t + lease_s), sid)
      move_count(status, 'running')
      leased[#leased + 1] = {sid, redis.call('HGETALL', skey), redis.call('GET', skey .. ':tok') or false,
        redis.call('GET', skey .. ':lp') or false, redis.call('GET', skey .. ':ver') or false,
        redis.call('GET', skey .. ':mask') or false}
    end
  end
end
return leased
"""

# ARGV: prefix, sid, worker, lease_seconds, tok, lp, ver, mask
_APPEND = """
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
local tok, lp, ver, mask = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local n = #mask
if #tok ~= 4 * n or #lp ~= 4 * n or #ver ~= 4 * n then
  return {-2, string.format('chunk bytes tok=%d lp=%d ver=%d mask=%d', #tok, #lp, #ver, #mask)}
end
local len_tok = redis.call('STRLEN', skey .. ':tok')
local len_lp = redis.call('STRLEN', skey .. ':lp')
local len_ver = redis.call('STRLEN', skey .. ':ver')
local len_mask = redis.call('STRLEN', skey .. ':mask')
if len_tok ~= 4 * len_mask or len_lp ~= 4 * len_mask or len_ver ~= 4 * len_mask then
  return {-3, string.format('stored bytes tok=%d lp=%d ver=%d mask=%d', len_tok, len_lp, len_ver, len_mask)}
end
if n > 0 then
  redis.call('APPEND', skey .. ':tok', tok)
  redis.call('APPEND', skey .. ':lp', lp)
  redis.call('APPEND', skey .. ':ver', ver)
  redis.call('APPEND', skey .. ':mask', mask)
  redis.call('HINCRBYFLOAT', P .. 'stats', 'generated_tokens', n)
end
local t = now()
redis.call('HSET', skey, 'updated_at', fmt(t))
redis.call('ZADD', P .. 'leases', fmt(t + tonumber(ARGV[4])), sid)
return {0, len_mask + n}
"""

# ARGV: prefix, worker, lease_seconds, sample ids...
_RENEW = """
local worker = ARGV[2]
local expiry = fmt(now() + tonumber(ARGV[3]))
local lost = {}
for i = 4, #ARGV do
  local sid = ARGV[i]
  if lost_lease(sid, worker) then
    lost[#lost + 1] = sid
  else
    redis.call('ZADD', P .. 'leases', expiry, sid)
  end
end
return lost
"""

# ARGV: prefix, sid, worker, status, reward ('' = none), failure ('' = none),
#       has_token_rewards ('0'|'1'), token_rewards bytes, metadata json ('' = unchanged)
_FINISH = """
local sid, worker, status = ARGV[2], ARGV[3], ARGV[4]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
if ARGV[7] == '1' and #ARGV[8] ~= 4 * redis.call('STRLEN', skey .. ':mask') then
  return {-2, string.format('token_rewards has %d values, the response %d tokens',
    #ARGV[8] / 4, redis.call('STRLEN', skey .. ':mask'))}
end
local t = fmt(now())
redis.call('HSET', skey, 'status', status, 'updated_at', t)
if ARGV[5] ~= '' then redis.call('HSET', skey, 'reward', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', skey, 'failure', ARGV[6]) end
if ARGV[7] == '1' then redis.call('HSET', skey, 'token_rewards', ARGV[8]) end
if ARGV[9] ~= '' then redis.call('HSET', skey, 'metadata', ARGV[9]) end
redis.call('HDEL', skey, 'lease_owner')
redis.call('ZREM', P .. 'leases', sid)
move_count('running', status)
if member_done(redis.call('HGET', skey, 'group_id')) then return {0, 1} end
return {0, 0}
"""

# ARGV: prefix, sid, worker
_RELEASE = """
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
requeue_running(sid)
return {0, 0}
"""

# ARGV: prefix
_REAP = """
local t = now()
local expired = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', fmt(t))
local requeued = {}
for _, sid in ipairs(expired) do
  redis.call('ZREM', P .. 'leases', sid)
  if redis.call('HGET', P .. 'sample:' .. sid, 'status') == 'running' then
    requeue_running(sid)
    requeued[#requeued + 1] = sid
  end
end
return requeued
"""

# ARGV: prefix, max_groups, step
_CLAIM = """
local max_groups, step = tonumber(ARGV[2]), ARGV[3]
local claimed = {}
while #claimed < max_groups do
  local gid = redis.call('LPOP', P .. 'queue:ready')
  if not gid then break end
  local gkey = P .. 'group:' .. gid
  if redis.call('HGET', gkey, 'status') == 'ready' then
    redis.call('HSET', gkey, 'status', 'claimed', 'claimed_step', step)
    redis.call('ZADD', P .. 'claimed', step, gid)
    claimed[#claimed + 1] = gid
  end
end
return claimed
"""

# ARGV: prefix, step
_COMMIT = """
local step = ARGV[2]
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', step, step)
for _, gid in ipairs(gids) do
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
return #gids
"""

# ARGV: prefix, step. Every claim of a step <= step becomes trained (their update is in a checkpoint).
_COMMIT_THROUGH = """
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', ARGV[2])
for _, gid in ipairs(gids) do
  local step = redis.call('ZSCORE', P .. 'claimed', gid)
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
return #gids
"""

# ARGV: prefix, after_step ('' = every uncommitted claim)
_REQUEUE = """
local low = '-inf'
if ARGV[2] ~= '' then low = '(' .. ARGV[2] end
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', low, '+inf')
-- pushed to the front in reverse, so the earliest claimed group is first in line again
for i = #gids, 1, -1 do
  local gid = gids[i]
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'ready')
  redis.call('HDEL', P .. 'group:' .. gid, 'claimed_step')
  redis.call('LPUSH', P .. 'queue:ready', gid)
end
return #gids
"""

# ARGV: prefix, gid, reason. Only a group waiting in the ready queue can be dropped.
_DROP_READY = """
local gid, reason = ARGV[2], ARGV[3]
if redis.call('LREM', P .. 'queue:ready', 0, gid) == 0 then return 0 end
local gkey = P .. 'group:' .. gid
redis.call('HSET', gkey, 'status', 'dropped', 'drop_reason', reason)
redis.call('ZADD', P .. 'dropped', fmt(now()), gid)
local tokens = 0
for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
  tokens = tokens + redis.call('STRLEN', P .. 'sample:' .. sid .. ':mask')
end
redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_groups:' .. reason, 1)
redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_tokens:' .. reason, tokens)
return 1
"""

# ARGV: prefix, sid, worker. Discard a leased sample's tokens so it starts over (staleness budget).
_RESTART = """
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
local n = redis.call('STRLEN', skey .. ':mask')
redis.call('DEL', skey .. ':tok', skey .. ':lp', skey .. ':ver', skey .. ':mask')
redis.call('HINCRBYFLOAT', P .. 'stats', 'restarted_tokens', n)
redis.call('HINCRBYFLOAT', P .. 'stats', 'restarted_samples', 1)
redis.call('HSET', skey, 'updated_at', fmt(now()))
return {0, n}
"""

# ARGV: prefix. Every leased sample back to the resume queue (a restarted job: the old workers are gone).
_REQUEUE_LEASED = """
local sids = redis.call('ZRANGE', P .. 'leases', 0, -1)
local n = 0
for _, sid in ipairs(sids) do
  redis.call('ZREM', P .. 'leases', sid)
  if redis.call('HGET', P .. 'sample:' .. sid, 'status') == 'running' then
    requeue_running(sid)
    n = n + 1
  end
end
return n
"""

# ARGV: prefix, chunk_tokens, max_segments, dry ('1': only count). Streaming (GLM-5 variant):
# a segment is every untrained token of a sample once there are >= chunk of them, or once the
# sample is final. A final sample whose tokens were all trained already yields its last token
# again (start = end - 1), so its reward still reaches the learner.
_CLAIM_SEGMENTS = """
local chunk, max_segments, dry = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local set = P .. 'stream:untrained'
local out, count = {}, 0
for _, sid in ipairs(redis.call('SMEMBERS', set)) do
  if count >= max_segments then break end
  local skey = P .. 'sample:' .. sid
  local status = redis.call('HGET', skey, 'status')
  if not status then
    redis.call('SREM', set, sid)
  else
    local len = redis.call('STRLEN', skey .. ':mask')
    local upto = tonumber(redis.call('HGET', skey, 'trained_upto') or '0')
    local final = status == 'completed' or status == 'truncated' or status == 'failed'
    if len - upto >= chunk or (final and len > 0) then
      count = count + 1
      if not dry then
        local start = upto
        if final and start >= len then start = len - 1 end
        redis.call('HSET', skey, 'trained_upto', len)
        if final then
          redis.call('SREM', set, sid)
          local gid = redis.call('HGET', skey, 'group_id')
          local gkey = P .. 'group:' .. gid
          if redis.call('HINCRBY', gkey, 'trained_members', 1) >= tonumber(redis.call('HGET', gkey, 'n')) then
            redis.call('LREM', P .. 'queue:ready', 0, gid)
            redis.call('HSET', gkey, 'status', 'trained')
            redis.call('ZADD', P .. 'trained', fmt(now()), gid)
          end
        end
        out[#out + 1] = sid
        out[#out + 1] = tostring(start)
        out[#out + 1] = tostring(len)
        out[#out + 1] = final and '1' or '0'
      end
    elseif final then
      redis.call('SREM', set, sid)  -- final with no tokens at all: nothing to train
    end
  end
end
if dry then return count end
return out
"""

# ARGV: prefix, sid. Dashboard control: a RUNNING sample back to the front of the resume queue,
# tokens kept, as if its lease had expired (the worker's next write finds the lease lost).
_FORCE_REQUEUE = """
local sid = ARGV[2]
local status = redis.call('HGET', P .. 'sample:' .. sid, 'status')
if not status then return {-4, ''} end
if status ~= 'running' then return {-5, status} end
requeue_running(sid)
return {0, status}
"""

# ARGV: prefix, sid, reason. Dashboard control: an unfinished sample becomes FAILED with the reason
# (its group can still complete). Stale queue entries are skipped by _LEASE, so no LREM is needed.
_DROP_SAMPLE = """
local sid, reason = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
local status = redis.call('HGET', skey, 'status')
if not status then return {-4, ''} end
if status ~= 'pending' and status ~= 'aborted' and status ~= 'running' then return {-5, status} end
redis.call('ZREM', P .. 'leases', sid)
redis.call('HDEL', skey, 'lease_owner')
redis.call('HSET', skey, 'status', 'failed', 'failure', reason, 'updated_at', fmt(now()))
move_count(status, 'failed')
redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_samples:dashboard', 1)
member_done(redis.call('HGET', skey, 'group_id'))
return {0, status}
"""

# ARGV: prefix, rank, pos, limit, max_scan, statuses (',a,b,' or '' for any), then min/max of
# length, reward, version span, age in seconds ('' = unbounded). Read-only listing for the dashboard:
# walks groups from creation rank `rank` down (newest first), samples from position `pos`, and
# returns {next rank, next pos, scanned, rows, server time}; a row is sid, the 8 _ROW_FIELDS
# ('' = absent), response length, first and last token version ('' when no tokens).
_SCAN_ROWS = """
local rank, pos = tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, max_scan, statuses = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local function bound(i) if ARGV[i] == '' then return nil end return tonumber(ARGV[i]) end
local min_len, max_len, min_rw, max_rw = bound(7), bound(8), bound(9), bound(10)
local min_span, max_span, min_age, max_age = bound(11), bound(12), bound(13), bound(14)
local t = now()
local function outside(x, lo, hi)
  if lo == nil and hi == nil then return false end
  if x == nil then return true end
  return (lo ~= nil and x < lo) or (hi ~= nil and x > hi)
end
local total = redis.call('ZCARD', P .. 'groups')
if rank >= total then rank, pos = total - 1, 0 end
local rows, found, scanned = {}, 0, 0
while rank >= 0 and found < limit and scanned < max_scan do
  local gid = redis.call('ZRANGE', P .. 'groups', rank, rank)[1]
  local sids = redis.call('LRANGE', P .. 'group:' .. gid .. ':samples', pos, -1)
  local i = 0
  while i < #sids and found < limit and scanned < max_scan do
    i = i + 1
    scanned = scanned + 1
    local sid = sids[i]
    local skey = P .. 'sample:' .. sid
    local f = redis.call('HMGET', skey, 'group_id', 'index', 'status', 'reward', 'failure', 'created_at',
      'updated_at', 'max_new_tokens')
    if f[3] and (statuses == '' or string.find(statuses, ',' .. f[3] .. ',', 1, true)) then
      local n = redis.call('STRLEN', skey .. ':mask')
      local first, last, span = '', '', nil
      if n > 0 then
        first = struct.unpack('<i4', redis.call('GETRANGE', skey .. ':ver', 0, 3))
        last = struct.unpack('<i4', redis.call('GETRANGE', skey .. ':ver', -4, -1))
        span = last - first
      end
      if not (outside(n, min_len, max_len) or outside(tonumber(f[4] or ''), min_rw, max_rw)
              or outside(span, min_span, max_span) or outside(t - tonumber(f[6]), min_age, max_age)) then
        found = found + 1
        rows[#rows + 1] = sid
        for k = 1, 8 do rows[#rows + 1] = f[k] or '' end
        rows[#rows + 1] = tostring(n)
        rows[#rows + 1] = tostring(first)
        rows[#rows + 1] = tostring(last)
      end
    end
  end
  if i >= #sids then rank, pos = rank - 1, 0 else pos = pos + i end
end
return {rank, pos, scanned, rows, fmt(t)}
"""

# ARGV: prefix, max_each. The first token's policy version of up to max_each running (leased) and
# aborted (resume queue) samples that have tokens: the dashboard's staleness, one round trip.
_FIRST_VERSIONS = """
local n = tonumber(ARGV[2])
local out = {}
local sids = redis.call('ZRANGE', P .. 'leases', 0, n - 1)
for _, sid in ipairs(redis.call('LRANGE', P .. 'queue:resume', 0, n - 1)) do sids[#sids + 1] = sid end
for _, sid in ipairs(sids) do
  local first = redis.call('GETRANGE', P .. 'sample:' .. sid .. ':ver', 0, 3)
  if #first == 4 then out[#out + 1] = struct.unpack('<i4', first) end
end
return out
"""

# Dashboard keys (additive): events (list, newest first), control (hash: paused, oversample),
# engines (hash worker_id -> health JSON), expert_load (hash 'layer:expert' -> routed tokens),
# steps (list of per-step metrics JSON), job_info (JSON string).
EVENTS_KEPT = 1000
STEPS_KEPT = 500


def _float_text(value: float) -> str:
    return repr(float(value))


def _reopen_buffer(url: str, job: str, lease_seconds: float, password: str | None) -> "RedisBuffer":
    return RedisBuffer(url, job, lease_seconds, password=password)


class RedisBuffer:
    """Trajectories, groups, leases and queues of one job in one Redis server."""

    def __init__(self, url: str, job: str, lease_seconds: float = 10.0, *, password: str | None = None) -> None:
        """``password``: the job's own redis-server requires one (kept out of the URL, which is
        shown and passed around); a password inside ``url`` wins over it."""
        if not JOB_NAME_PATTERN.match(job):
            raise ValueError(f"job name {job!r} must match {JOB_NAME_PATTERN.pattern} (it becomes a key prefix)")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.url = url
        self.job = job
        self.lease_seconds = float(lease_seconds)
        self._password = password
        self.prefix = f"slime:{job}:"
        # No automatic retries: resending a script after a dropped reply could append a chunk twice.
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=10, retry=Retry(NoBackoff(), 0),
                                          password=password)
        self._add_group = self.redis.register_script(_PRELUDE + _ADD_GROUP)
        self._lease = self.redis.register_script(_PRELUDE + _LEASE)
        self._append = self.redis.register_script(_PRELUDE + _APPEND)
        self._renew = self.redis.register_script(_PRELUDE + _RENEW)
        self._finish = self.redis.register_script(_PRELUDE + _FINISH)
        self._release = self.redis.register_script(_PRELUDE + _RELEASE)
        self._reap = self.redis.register_script(_PRELUDE + _REAP)
        self._claim = self.redis.register_script(_PRELUDE + _CLAIM)
        self._commit = self.redis.register_script(_PRELUDE + _COMMIT)
        self._requeue = self.redis.register_script(_PRELUDE + _REQUEUE)
        self._drop_ready = self.redis.register_script(_PRELUDE + _DROP_READY)
        self._commit_through = self.redis.register_script(_PRELUDE + _COMMIT_THROUGH)
        self._restart = self.redis.register_script(_PRELUDE + _RESTART)
        self._requeue_leased = self.redis.register_script(_PRELUDE + _REQUEUE_LEASED)
        self._claim_segments = self.redis.register_script(_PRELUDE + _CLAIM_SEGMENTS)
        self._force_requeue = self.redis.register_script(_PRELUDE + _FORCE_REQUEUE)
        self._drop_sample = self.redis.register_script(_PRELUDE + _DROP_SAMPLE)
        self._scan_rows = self.redis.register_script(_PRELUDE + _SCAN_ROWS)
        self._first_versions = self.redis.register_script(_PRELUDE + _FIRST_VERSIONS)

    # Ray actors and worker processes get their own connection from the same (url, job).
    def __reduce__(self) -> tuple:
        return (_reopen_buffer, (self.url, self.job, self.lease_seconds, self._password))

    def __repr__(self) -> str:
        return f"RedisBuffer(job={self.job!r}, url={redact_url(self.url)!r})"

    def close(self) -> None:
        self.redis.close()

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # ---- writes -------------------------------------------------------------------------------

    def add_group(
        self,
        prompt_ids: np.ndarray | Sequence[int],
        n: int,
        max_new_tokens: int,
        metadata: dict[str, Any],
        group_id: str | None = None,
    ) -> str:
        """Create a group of n PENDING samples of one prompt, queued on `new`. Returns the group id."""
        if n < 1:
            raise ValueError(f"a group needs n >= 1 samples, got {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        group_id = group_id or new_id()
        prompt = np.asarray(prompt_ids, dtype=TOKEN_DTYPE).reshape(-1).astype(WIRE_TOKEN).tobytes()
        sample_ids = [new_id() for _ in range(n)]
        created = self._add_group(
            args=[self.prefix, group_id, n, int(max_new_tokens), prompt, json.dumps(metadata), *sample_ids]
        )
        if not created:
            raise ValueError(f"group {group_id!r} already exists in job {self.job!r}")
        return group_id

    def lease(self, worker_id: str, max_items: int) -> list[Sample]:
        """Lease up to max_items samples, resume queue first, then new prompts; they become RUNNING."""
        if max_items <= 0:
            return []
        leased = self._lease(args=[self.prefix, worker_id, int(max_items), self.lease_seconds])
        return [
            _decode_sample(sid.decode(), dict(zip(flat[::2], flat[1::2])), tok, lp, ver, mask)
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
    ) -> int:
        """Append one chunk to the four per-token arrays and refresh the lease. Returns the new length."""
        tokens, lps, versions, mask = normalize_chunk(token_ids, logprobs, version, loss_mask)
        code, detail = self._append(
            args=[
                self.prefix,
                sample_id,
                worker_id,
                self.lease_seconds,
                tokens.astype(WIRE_TOKEN).tobytes(),
                lps.astype(WIRE_LOGPROB).tobytes(),
                versions.astype(WIRE_VERSION).tobytes(),
                mask.astype(WIRE_MASK).tobytes(),
            ]
        )
        self._raise_for(code, detail, sample_id, worker_id)
        return int(detail)

    def append_chunks(
        self, worker_id: str, chunks: Sequence[tuple[str, Sequence[int], Sequence[float], Sequence[int]]]
    ) -> list[int | Exception]:
        """Many `append_chunk`s (sample_id, token_ids, logprobs, versions; loss mask 1) in one round
        trip; each stays atomic on its own. Per chunk: the new length, or the error it raised."""
        return self.send_append_chunks(worker_id, chunks).wait()

    def send_append_chunks(
        self, worker_id: str, chunks: Sequence[tuple[str, Sequence[int], Sequence[float], Sequence[int]]]
    ) -> "PendingReplies":
        """`append_chunks`, sent now; its replies are read by ``.wait()``. The rollout thread runs an
        engine step in between, while Redis executes the scripts (on another core)."""
        calls = []
        for sample_id, token_ids, logprobs, versions in chunks:
            tokens, lps, vers, mask = normalize_chunk(token_ids, logprobs, versions, 1)
            calls.append([
                self.prefix, sample_id, worker_id, self.lease_seconds,
                tokens.astype(WIRE_TOKEN).tobytes(), lps.astype(WIRE_LOGPROB).tobytes(),
                vers.astype(WIRE_VERSION).tobytes(), mask.astype(WIRE_MASK).tobytes(),
            ])
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
        result = self.finish_many(worker_id, [Finish(sample_id, status, reward, failure, token_rewards, metadata_update)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def finish_many(self, worker_id: str, finishes: Sequence[Finish]) -> list[bool | Exception]:
        """`finish` for many samples in one round trip (one more to read the stored metadata that a
        metadata update merges into, unless the caller gives it); per sample whether it completed
        its group, or the error it raised."""
        return self.send_finish_many(worker_id, finishes).wait()

    def send_finish_many(self, worker_id: str, finishes: Sequence[Finish]) -> "PendingReplies":
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
            for f in finishes if f.metadata_update and f.stored_metadata is not None
        }
        merging = [f for f in finishes if f.metadata_update and f.stored_metadata is None]
        if merging:
            pipe = self.redis.pipeline(transaction=False)
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
            calls.append([
                self.prefix,
                f.sample_id,
                worker_id,
                status.value,
                "" if f.reward is None else _float_text(f.reward),
                f.failure or "",
                "0" if f.token_rewards is None else "1",
                token_reward_bytes,
                metadata_json.get(id(f), ""),
            ])
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

    def claim_groups(self, max_groups: int, step: int) -> list[list[Sample]]:
        """Pop up to max_groups complete groups for training `step`; each group's samples by index."""
        if max_groups <= 0:
            return []
        group_ids = [gid.decode() for gid in self._claim(args=[self.prefix, int(max_groups), int(step)])]
        return [self.get_group(gid) for gid in group_ids]

    def commit_step(self, step: int) -> int:
        """Mark the groups claimed by `step` as trained. Returns how many."""
        return int(self._commit(args=[self.prefix, int(step)]))

    def commit_through(self, step: int) -> int:
        """Mark every group claimed by a step <= `step` as trained. Returns how many."""
        return int(self._commit_through(args=[self.prefix, int(step)]))

    def requeue_uncommitted(self, after_step: int | None = None) -> int:
        """Put claimed-but-uncommitted groups (claimed by a step > after_step; all if None) back to ready."""
        return int(self._requeue(args=[self.prefix, "" if after_step is None else int(after_step)]))

    def wait_for_ready_signal(self, timeout_s: float) -> bool:
        """Block until a group turned ready since the last call (True), or ``timeout_s`` passed."""
        return self.redis.blpop([self._key("signal", "ready")], timeout=timeout_s) is not None

    def ready_group_ids(self) -> list[str]:
        return [gid.decode() for gid in self.redis.lrange(self._key("queue", "ready"), 0, -1)]

    def drop_ready_group(self, group_id: str, reason: str) -> bool:
        """Take a complete group out of the ready queue for good (e.g. a dynamic-sampling filter);
        counted in stats as dropped_groups:<reason> and dropped_tokens:<reason>."""
        return bool(self._drop_ready(args=[self.prefix, group_id, reason]))

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

    def track_streaming(self, group_id: str) -> None:
        """Streaming mode: the group's samples are trained segment by segment (claim_segments)."""
        sample_ids = self.redis.lrange(self._key("group", group_id, "samples"), 0, -1)
        if sample_ids:
            self.redis.sadd(self._key("stream", "untrained"), *sample_ids)

    def count_segments(self, chunk_tokens: int) -> int:
        return int(self._claim_segments(args=[self.prefix, int(chunk_tokens), 1 << 30, "1"]))

    def claim_segments(self, chunk_tokens: int, max_segments: int) -> list[tuple[Sample, int, bool]]:
        """Atomically take up to max_segments trainable segments: (sample as stored now, start, final).
        The sample's tokens [start, response_length) are the segment; each token is claimed once."""
        flat = self._claim_segments(args=[self.prefix, int(chunk_tokens), int(max_segments), "0"])
        out = []
        for i in range(0, len(flat), 4):
            sid, start, end, final = flat[i].decode(), int(flat[i + 1]), int(flat[i + 2]), flat[i + 3] == b"1"
            sample = self.get_sample(sid)
            # A worker may have appended more since the claim: the segment ends where the claim did.
            sample.response_ids, sample.logprobs = sample.response_ids[:end], sample.logprobs[:end]
            sample.versions, sample.loss_mask = sample.versions[:end], sample.loss_mask[:end]
            out.append((sample, start, final))
        return out

    def incr_stat(self, name: str, amount: float = 1.0) -> float:
        return float(self.redis.hincrbyfloat(self._key("stats"), name, amount))

    def set_policy_version(self, version: int) -> None:
        self.redis.set(self._key("policy_version"), int(version))

    def delete_job(self) -> int:
        """Delete every key of this job (and only this job). Returns how many keys were removed."""
        removed = 0
        batch: list[bytes] = []
        for key in self.redis.scan_iter(match=self.prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += self.redis.unlink(*batch)
                batch = []
        if batch:
            removed += self.redis.unlink(*batch)
        return removed

    # ---- reads --------------------------------------------------------------------------------

    def get_sample(self, sample_id: str) -> Sample:
        samples = self._load_samples([sample_id])
        if not samples:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        return samples[0]

    def get_group(self, group_id: str) -> list[Sample]:
        sample_ids = [sid.decode() for sid in self.redis.lrange(self._key("group", group_id, "samples"), 0, -1)]
        if not sample_ids:
            raise KeyError(f"group {group_id!r} not found in job {self.job!r}")
        return sorted(self._load_samples(sample_ids), key=lambda s: s.index)

    def counts(self) -> dict[str, int]:
        """Samples by status, queue lengths, groups by stage and running leases (all O(1) reads)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self._key("status_counts"))
        pipe.llen(self._key("queue", "resume"))
        pipe.llen(self._key("queue", "new"))
        pipe.llen(self._key("queue", "ready"))
        pipe.zcard(self._key("groups"))
        pipe.zcard(self._key("claimed"))
        pipe.zcard(self._key("trained"))
        pipe.zcard(self._key("leases"))
        pipe.zcard(self._key("dropped"))
        by_status, resume, new, ready, groups, claimed, trained, leases, dropped = pipe.execute()
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

    def stats(self) -> dict[str, float]:
        return {name.decode(): float(value) for name, value in self.redis.hgetall(self._key("stats")).items()}

    def get_policy_version(self) -> int:
        value = self.redis.get(self._key("policy_version"))
        return int(value) if value is not None else 0

    def running_ids(self) -> list[str]:
        return [sid.decode() for sid in self.redis.zrange(self._key("leases"), 0, -1)]

    def iter_samples(self, status: Status | None = None, batch_size: int = 256) -> Iterator[Sample]:
        """Every sample of the job (SCAN order), optionally only one status. For dashboards and tests."""
        wanted = Status(status) if status is not None else None
        head = self._key("sample", "")
        batch: list[str] = []
        # The per-token arrays share the `sample:` prefix but are strings; TYPE keeps only the hashes.
        for key in self.redis.scan_iter(match=head + "*", count=1000, _type="hash"):
            batch.append(key.decode()[len(head) :])
            if len(batch) >= batch_size:
                yield from (s for s in self._load_samples(batch) if wanted is None or s.status == wanted)
                batch = []
        if batch:
            yield from (s for s in self._load_samples(batch) if wanted is None or s.status == wanted)

    # ---- dashboard: control, events, engine/expert load, step history (additive keys) ---------

    def force_requeue(self, sample_id: str) -> None:
        """A RUNNING sample back to the front of the resume queue, tokens kept (its worker drops it)."""
        code, detail = self._force_requeue(args=[self.prefix, sample_id])
        self._raise_for_control(code, detail, sample_id, "requeue", "running")

    def drop_sample(self, sample_id: str, reason: str) -> str:
        """An unfinished (pending, aborted or running) sample becomes FAILED with `reason`.
        Returns the status it had."""
        code, detail = self._drop_sample(args=[self.prefix, sample_id, reason])
        self._raise_for_control(code, detail, sample_id, "drop", "pending, aborted or running")
        return detail.decode()

    def _raise_for_control(self, code: int, detail: bytes, sample_id: str, action: str, allowed: str) -> None:
        if code == _NO_SAMPLE:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        if code != _OK:
            raise ValueError(f"cannot {action} sample {sample_id!r}: its status is {detail.decode()}, not {allowed}")

    def log_event(self, kind: str, detail: dict[str, Any]) -> dict[str, Any]:
        event = {"ts": self.server_time(), "kind": kind, "detail": detail}
        pipe = self.redis.pipeline(transaction=True)
        pipe.lpush(self._key("events"), json.dumps(event))
        pipe.ltrim(self._key("events"), 0, EVENTS_KEPT - 1)
        pipe.execute()
        return event

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.redis.lrange(self._key("events"), 0, max(0, limit - 1))]

    def server_time(self) -> float:
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def set_control(self, **fields: str) -> None:
        self.redis.hset(self._key("control"), mapping=fields)

    def get_control(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(self._key("control")).items()}

    def record_engine_health(self, healths: Sequence[dict[str, Any]]) -> None:
        if healths:
            now = self.server_time()
            self.redis.hset(
                self._key("engines"),
                mapping={str(h.get("worker_id", i)): json.dumps({**h, "published_at": now}) for i, h in enumerate(healths)},
            )

    def engine_health(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in self.redis.hgetall(self._key("engines")).items()}

    def add_expert_load(self, counts: np.ndarray) -> None:
        """Add routed-token counts, shape (layers, experts)."""
        pipe = self.redis.pipeline(transaction=False)
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
        out = np.zeros((max(l for l, _ in cells) + 1, max(e for _, e in cells) + 1), dtype=np.int64)
        for (layer, expert), n in cells.items():
            out[layer, expert] = n
        return out

    def record_step(self, step: int, metrics: dict[str, float]) -> None:
        pipe = self.redis.pipeline(transaction=True)
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

    def group_count(self) -> int:
        return int(self.redis.zcard(self._key("groups")))

    def group_ids_by_rank(self, lo: int, hi: int) -> list[str]:
        """Group ids of creation ranks lo..hi (0 = oldest; the `groups` zset is the index, no SCAN).
        Ranks are stable while groups are added, so they make page cursors."""
        return [g.decode() for g in self.redis.zrange(self._key("groups"), max(0, lo), hi)]

    def group_rows(self, group_ids: Sequence[str]) -> list[tuple[dict[str, str], list[str]]]:
        """Per group: its hash fields and its sample ids, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for gid in group_ids:
            pipe.hgetall(self._key("group", gid))
            pipe.lrange(self._key("group", gid, "samples"), 0, -1)
        replies = pipe.execute()
        return [
            ({k.decode(): v.decode() for k, v in replies[2 * i].items()}, [s.decode() for s in replies[2 * i + 1]])
            for i in range(len(group_ids))
        ]

    def scan_rows(
        self, rank: int, pos: int, limit: int, max_scan: int, statuses: Sequence[str] = (),
        bounds: dict[str, tuple[float | None, float | None]] | None = None,
    ) -> tuple[list[dict[str, Any]], int, int, int, float]:
        """Newest-first listing done inside Redis (one call, at most max_scan samples examined):
        light rows (as `sample_rows`) matching the statuses and the (low, high) bounds on `length`,
        `reward`, `version_span` and `age_s` (by the Redis server's clock). Returns (rows, next rank,
        next pos, scanned, server time); rank -1 means the oldest group was passed."""
        bounds = bounds or {}
        args: list[Any] = [self.prefix, int(rank), int(pos), int(limit), int(max_scan),
                           "," + ",".join(statuses) + "," if statuses else ""]
        for name in ("length", "reward", "version_span", "age_s"):
            for value in bounds.get(name, (None, None)):
                args.append("" if value is None else repr(float(value)))
        next_rank, next_pos, scanned, flat, server_time = self._scan_rows(args=args)
        rows = []
        for i in range(0, len(flat), 12):
            sid, *fields, length, first, last = (v.decode() for v in flat[i : i + 12])
            row: dict[str, Any] = {"id": sid}
            for name, value in zip(self._ROW_FIELDS, fields):
                row[name] = value if value != "" else None
            row["response_length"] = int(length)
            row["min_version"] = int(first) if first != "" else None
            row["max_version"] = int(last) if last != "" else None
            rows.append(row)
        return rows, int(next_rank), int(next_pos), int(scanned), float(server_time)

    def first_versions(self, max_each: int = 256, client: Any = None) -> Any:
        """First-token policy versions of up to max_each running and max_each aborted samples."""
        return self._first_versions(args=[self.prefix, int(max_each)], client=client)

    _ROW_FIELDS = ("group_id", "index", "status", "reward", "failure", "created_at", "updated_at", "max_new_tokens")

    def sample_rows(self, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Light per-sample rows (no token arrays) in one round trip: the hash fields above plus
        response length and the first/last token's policy version (versions never decrease)."""
        pipe = self.redis.pipeline(transaction=False)
        for sid in sample_ids:
            key = self._key("sample", sid)
            pipe.hmget(key, self._ROW_FIELDS)
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
            for name, value in zip(self._ROW_FIELDS, values):
                row[name] = value.decode() if value is not None else None
            row["response_length"] = int(length)
            row["min_version"] = int(np.frombuffer(first, WIRE_VERSION)[0]) if len(first) == 4 else None
            row["max_version"] = int(np.frombuffer(last, WIRE_VERSION)[0]) if len(last) == 4 and length else None
            rows.append(row)
        return rows

    # ---- internals ----------------------------------------------------------------------------

    def _run_per_sample(self, script: Any, calls: Sequence[Sequence[Any]], value: Callable[[Any], Any]) -> list[Any]:
        """A per-sample script (ARGV: prefix, sample id, worker, ...; reply {code, detail}) over many
        argument lists in one round trip: per call value(detail), or the error its code stands for."""
        return PendingReplies(self, script, list(calls), value).wait()

    def _raise_for(self, code: int, detail: bytes | int, sample_id: str, worker_id: str) -> None:
        if code == _OK:
            return
        text = detail.decode() if isinstance(detail, bytes) else str(detail)
        if code == _LEASE_LOST:
            raise LeaseLostError(
                f"job {self.job!r}: worker {worker_id!r} no longer holds the lease on sample {sample_id!r} "
                f"(lease owner now: {text or 'none'})"
            )
        if code == _NO_SAMPLE:
            raise KeyError(f"sample {sample_id!r} not found in job {self.job!r}")
        if code in (_BAD_CHUNK, _STORED_MISMATCH):
            raise ChunkLengthError(f"sample {sample_id!r}: per-token arrays would differ in length ({text})")
        raise RuntimeError(f"sample {sample_id!r}: unexpected buffer script reply {code}: {text}")

    def _load_samples(self, sample_ids: Sequence[str]) -> list[Sample]:
        """Read samples (hash and arrays) in one MULTI/EXEC, so each is a consistent snapshot."""
        if not sample_ids:
            return []
        pipe = self.redis.pipeline(transaction=True)
        for sid in sample_ids:
            key = self._key("sample", sid)
            pipe.hgetall(key)
            pipe.get(key + ":tok")
            pipe.get(key + ":lp")
            pipe.get(key + ":ver")
            pipe.get(key + ":mask")
        replies = pipe.execute()
        samples = []
        for i, sid in enumerate(sample_ids):
            fields, tok, lp, ver, mask = replies[5 * i : 5 * i + 5]
            if fields:
                samples.append(_decode_sample(sid, fields, tok, lp, ver, mask))
        return samples


def _array(data: bytes | None, wire_dtype: str, dtype: type) -> np.ndarray:
    # astype copies, so the Sample owns writable arrays (frombuffer alone would be read-only).
    return np.frombuffer(data or b"", dtype=wire_dtype).astype(dtype)


def _decode_sample(
    sample_id: str,
    raw_fields: dict[bytes, bytes],
    tok: bytes | None,
    lp: bytes | None,
    ver: bytes | None,
    mask: bytes | None,
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
        status=Status(fields["status"].decode()),
        reward=float(reward) if reward is not None else None,
        token_rewards=_array(token_rewards, WIRE_LOGPROB, np.float32) if token_rewards is not None else None,
        failure=failure.decode() if failure is not None else None,
        metadata=json.loads(fields["metadata"]),
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
    )


class PendingReplies:
    """Per-sample scripts sent as EVALSHA in one pipeline on a connection of their own, replies not
    read yet (redis-py's pipelines of Script calls ask SCRIPT EXISTS first: one more round trip).

    ``wait()`` reads them (once): per call value(detail), or the error its code stands for. A
    server without the script (first use, or restarted) answers NOSCRIPT: the script is loaded and
    only the calls it refused are sent again, since the others have already been executed.
    """

    def __init__(self, buffer: RedisBuffer, script: Any, calls: list[list[Any]], value: Callable[[Any], Any]):
        self.buffer, self.script, self.calls, self.value = buffer, script, calls, value
        self.results: list[Any] | None = [] if not calls else None
        self.connection = self._send(calls) if calls else None

    def _send(self, calls: list[list[Any]]):
        pool = self.buffer.redis.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands([("EVALSHA", self.script.sha, 0, *args) for args in calls]))
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        return connection

    def _read(self, connection, n: int) -> list[Any]:
        """n replies; a NOSCRIPT error is returned in its call's place."""
        replies: list[Any] = []
        try:
            for _ in range(n):
                try:
                    replies.append(connection.read_response())
                except redis.exceptions.NoScriptError as exc:
                    replies.append(exc)
        except BaseException:
            connection.disconnect()  # replies half read: the connection cannot be reused
            raise
        finally:
            self.buffer.redis.connection_pool.release(connection)
        return replies

    def wait(self) -> list[Any]:
        if self.results is not None:
            return self.results
        connection, self.connection = self.connection, None
        replies = self._read(connection, len(self.calls))
        refused = [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
        if refused:
            self.buffer.redis.script_load(self.script.script)
            again = self._read(self._send([self.calls[i] for i in refused]), len(refused))
            for i, reply in zip(refused, again):
                if isinstance(reply, Exception):
                    raise reply
                replies[i] = reply
        results: list[Any] = []
        for args, (code, detail) in zip(self.calls, replies):
            try:
                self.buffer._raise_for(code, detail, args[1], args[2])
                results.append(self.value(detail))
            except (LeaseLostError, KeyError, ChunkLengthError, RuntimeError) as exc:
                results.append(exc)
        self.results = results
        return results
