-- ARGV: prefix, step, keep ('' = keep every trajectory). Every claim of a step <= step becomes
-- trained (their update is in a checkpoint). With keep, the trajectories of groups trained at a
-- step <= step - keep are deleted (hashes and per-token arrays), and so are those of groups the
-- filter dropped before that step's checkpoint: the buffer's memory stays bounded over a long job.
-- The group's hash and its place in the stage sets stay (a few bytes), so the group counts go on
-- counting it; the sample counts drop the pruned samples, which the stats count.
local stats = P .. 'stats'
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', ARGV[2])
for _, gid in ipairs(gids) do
  local step = redis.call('ZSCORE', P .. 'claimed', gid)
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
if ARGV[3] == '' then return #gids end
-- When each step's checkpoint was committed (score: step, member: server time): the horizon for
-- dropped groups, which have a drop time but no step.
redis.call('ZADD', P .. 'commit_times', ARGV[2], fmt(now()))

local samples, tokens = 0, 0
local function prune(gid)
  local gkey = P .. 'group:' .. gid
  for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
    local skey = P .. 'sample:' .. sid
    local status = redis.call('HGET', skey, 'status')
    if status then
      redis.call('HINCRBY', P .. 'status_counts', status, -1)
      tokens = tokens + redis.call('STRLEN', skey .. ':mask')
      samples = samples + redis.call('DEL', skey)
    end
    redis.call('DEL', skey .. ':tok', skey .. ':lp', skey .. ':ver', skey .. ':mask', skey .. ':route')
  end
  redis.call('DEL', gkey .. ':samples')
  redis.call('HSET', gkey, 'pruned', 1)
end

local upto = tonumber(ARGV[2]) - tonumber(ARGV[3])
local done = tonumber(redis.call('HGET', stats, 'pruned_through_step') or '-1')
local groups = 0
if upto > done then
  local old = redis.call('ZRANGEBYSCORE', P .. 'trained', '(' .. done, upto)
  for _, gid in ipairs(old) do prune(gid) end
  groups = groups + #old
  redis.call('HSET', stats, 'pruned_through_step', upto)
end
local mark = redis.call('ZREVRANGEBYSCORE', P .. 'commit_times', upto, '-inf', 'LIMIT', 0, 1)[1]
if mark then
  local from = redis.call('HGET', stats, 'pruned_dropped_through')
  local dropped = redis.call('ZRANGEBYSCORE', P .. 'dropped', from and ('(' .. from) or '-inf', mark)
  for _, gid in ipairs(dropped) do prune(gid) end
  groups = groups + #dropped
  redis.call('HSET', stats, 'pruned_dropped_through', mark)
  redis.call('ZREMRANGEBYSCORE', P .. 'commit_times', '-inf', '(' .. upto)  -- older marks: never needed again
end
redis.call('HINCRBY', stats, 'pruned_groups', groups)
redis.call('HINCRBY', stats, 'pruned_samples', samples)
redis.call('HINCRBY', stats, 'pruned_tokens', tokens)
return #gids
