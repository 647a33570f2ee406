-- Trajectory state changes shared by the store's scripts and the dashboard's control scripts
-- (loaded after prelude.lua, before the script that uses them).
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
-- Group `gid` leaves `zset` (claimed or trained) and waits for training again, at the front of the
-- ready queue (callers go from the last group to the first, so the earliest is first in line).
local function back_to_ready(zset, gid)
  redis.call('ZREM', P .. zset, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'ready')
  redis.call('HDEL', P .. 'group:' .. gid, 'claimed_step')
  redis.call('LPUSH', P .. 'queue:ready', gid)
end
-- nil when `worker` holds the lease on `sid`, else the current owner ('' for none)
local function lost_lease(sid, worker)
  local owner = redis.call('HGET', P .. 'sample:' .. sid, 'lease_owner')
  if owner == worker and redis.call('ZSCORE', P .. 'leases', sid) then return nil end
  return owner or ''
end
-- Group `gid` leaves training for good: dropped with the reason, in the dropped zset, its tokens
-- counted in stats (dropped_groups:<reason>, dropped_tokens:<reason>). Returns those tokens.
local function drop_group(gid, reason)
  local gkey = P .. 'group:' .. gid
  redis.call('HSET', gkey, 'status', 'dropped', 'drop_reason', reason)
  redis.call('HDEL', gkey, 'claimed_step')
  redis.call('ZADD', P .. 'dropped', fmt(now()), gid)
  local tokens = 0
  for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
    tokens = tokens + redis.call('STRLEN', P .. 'sample:' .. sid .. ':mask')
  end
  redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_groups:' .. reason, 1)
  redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_tokens:' .. reason, tokens)
  return tokens
end
