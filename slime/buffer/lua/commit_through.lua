-- ARGV: prefix, step, keep ('' = keep every trajectory), budget, offset, first ('1' on the first call),
-- records ('' = keep every group record; else >= keep). Every claim of a step <=
-- step becomes trained (their update is in a checkpoint). With keep, the trajectories of groups
-- trained at a step <= step - keep are deleted (hashes and per-token arrays), and so are those of
-- groups the filter dropped before that step's checkpoint: the buffer's memory stays bounded over a
-- long job. The group's hash (less its metadata) and its place in the stage sets stay (~300 bytes), so the group counts
-- go on counting it; the sample counts drop the pruned samples, which the stats count.
-- With records, the group records of pruned groups trained at a step <= step - records (dropped ones:
-- before that step's checkpoint) are deleted too, their hash and their place in the group sets; the
-- group counts go on counting them through stats forgotten_groups_trained / _dropped. Without this a
-- long job's Redis grew ~0.8 KB a group for good.
-- At most `budget` groups are pruned (or forgotten) per call, so that no call holds the server long: the reply is
-- {groups committed, the offset to call again with, or -1 when nothing is left to prune}.
local stats = P .. 'stats'
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', ARGV[2])
for _, gid in ipairs(gids) do
  local step = redis.call('ZSCORE', P .. 'claimed', gid)
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
if ARGV[3] == '' then return {#gids, -1} end
local budget, offset = tonumber(ARGV[4]), tonumber(ARGV[5])
if ARGV[6] == '1' then
  -- When each step's checkpoint was committed (score: step, member: server time): the horizon for
  -- dropped groups, which have a drop time but no step.
  redis.call('ZADD', P .. 'commit_times', ARGV[2], fmt(now()))
end

local groups, samples, tokens = 0, 0, 0
local function prune(gid)
  local gkey = P .. 'group:' .. gid
  if redis.call('HGET', gkey, 'pruned') then return end
  for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
    local skey = P .. 'sample:' .. sid
    local status = redis.call('HGET', skey, 'status')
    if status then
      redis.call('HINCRBY', P .. 'status_counts', status, -1)
      tokens = tokens + redis.call('STRLEN', skey .. ':mask')
      samples = samples + redis.call('UNLINK', skey)
    end
    redis.call('UNLINK', skey .. ':tok', skey .. ':lp', skey .. ':ver', skey .. ':mask', skey .. ':route', skey .. ':env')
  end
  redis.call('UNLINK', gkey .. ':samples')
  -- The row's metadata (prompt text, label, every other column: KBs for a task that carries its
  -- repository) goes with the trajectories; what stays per group is a few fixed-size fields.
  redis.call('HDEL', gkey, 'metadata')
  redis.call('HSET', gkey, 'pruned', 1)
  groups = groups + 1
end
local function counted(next_offset)
  redis.call('HINCRBY', stats, 'pruned_groups', groups)
  redis.call('HINCRBY', stats, 'pruned_samples', samples)
  redis.call('HINCRBY', stats, 'pruned_tokens', tokens)
  return {#gids, next_offset}
end

-- Trained groups, by step; the offset runs through this range until it is done (it cannot grow:
-- later claims train at later steps).
local upto = tonumber(ARGV[2]) - tonumber(ARGV[3])
local done = tonumber(redis.call('HGET', stats, 'pruned_through_step') or '-1')
if upto > done then
  local old = redis.call('ZRANGEBYSCORE', P .. 'trained', '(' .. done, upto, 'LIMIT', offset, budget)
  for _, gid in ipairs(old) do prune(gid) end
  if #old == budget then return counted(offset + budget) end
  redis.call('HSET', stats, 'pruned_through_step', upto)
  budget, offset = budget - #old, 0
  if budget == 0 then return counted(0) end
end
-- Then dropped groups, up to when the checkpoint of the latest step <= upto was committed.
local mark = redis.call('ZREVRANGEBYSCORE', P .. 'commit_times', upto, '-inf', 'LIMIT', 0, 1)[1]
if mark then
  local from = redis.call('HGET', stats, 'pruned_dropped_through')
  local range_start = from and ('(' .. from) or '-inf'
  local dropped = redis.call('ZRANGEBYSCORE', P .. 'dropped', range_start, mark, 'LIMIT', offset, budget)
  for _, gid in ipairs(dropped) do prune(gid) end
  if #dropped == budget then return counted(offset + budget) end
  redis.call('HSET', stats, 'pruned_dropped_through', mark)
  budget = budget - #dropped
end
if ARGV[7] == '' then
  redis.call('ZREMRANGEBYSCORE', P .. 'commit_times', '-inf', '(' .. upto)  -- older marks: never needed again
  return counted(-1)
end

-- Then the records of pruned groups beyond the records horizon. Each one forgotten leaves the sets,
-- so every call scans from the start; a group not pruned (none expected) is stepped over.
local records_upto = tonumber(ARGV[2]) - tonumber(ARGV[7])
local cursor = redis.call('GET', P .. 'claim_cursor')  -- async claims in start order: a rank in 'groups'
cursor = cursor and tonumber(cursor)
local forgotten = {trained = 0, dropped = 0}
local function forget(gid, stage)
  local gkey = P .. 'group:' .. gid
  if not redis.call('HGET', gkey, 'pruned') then return false end
  if cursor then
    local rank = redis.call('ZRANK', P .. 'groups', gid)
    if rank and rank < cursor then cursor = cursor - 1 end
  end
  redis.call('ZREM', P .. 'groups', gid)
  redis.call('ZREM', P .. stage, gid)
  redis.call('UNLINK', gkey)
  forgotten[stage] = forgotten[stage] + 1
  return true
end
local function forget_range(stage, upper)
  local skipped = 0
  while budget > 0 do
    local gids = redis.call('ZRANGEBYSCORE', P .. stage, '-inf', upper, 'LIMIT', skipped, budget)
    if #gids == 0 then return end
    for _, gid in ipairs(gids) do
      if forget(gid, stage) then budget = budget - 1 else skipped = skipped + 1 end
    end
  end
end
local function forgotten_counted(next_offset)
  if cursor then redis.call('SET', P .. 'claim_cursor', cursor) end
  redis.call('HINCRBY', stats, 'forgotten_groups_trained', forgotten.trained)
  redis.call('HINCRBY', stats, 'forgotten_groups_dropped', forgotten.dropped)
  return counted(next_offset)
end
if records_upto >= 0 then
  forget_range('trained', records_upto)
  local records_mark = redis.call('ZREVRANGEBYSCORE', P .. 'commit_times', records_upto, '-inf', 'LIMIT', 0, 1)[1]
  if records_mark then forget_range('dropped', records_mark) end
  if budget == 0 then return forgotten_counted(0) end
  -- Never back: a resume's commit_through (an older checkpoint's step) forgets nothing new.
  local through = tonumber(redis.call('HGET', stats, 'forgotten_through_step') or '-1')
  if records_upto > through then redis.call('HSET', stats, 'forgotten_through_step', records_upto) end
end
-- Marks older than both horizons are never needed again.
redis.call('ZREMRANGEBYSCORE', P .. 'commit_times', '-inf', '(' .. math.min(upto, records_upto))
return forgotten_counted(-1)
