-- ARGV: prefix, step, keep ('' = keep every trained group). Every claim of a step <= step becomes
-- trained (their update is in a checkpoint). With keep, the trajectories of groups trained at a
-- step <= step - keep are deleted (hashes and per-token arrays): the buffer's memory stays bounded
-- over a long job. The group's hash and its place in the stage sets stay (a few bytes), so the
-- group counts go on counting it; the sample counts drop the pruned samples, which the stats count.
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', ARGV[2])
for _, gid in ipairs(gids) do
  local step = redis.call('ZSCORE', P .. 'claimed', gid)
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
if ARGV[3] ~= '' then
  local stats = P .. 'stats'
  local upto = tonumber(ARGV[2]) - tonumber(ARGV[3])
  local done = tonumber(redis.call('HGET', stats, 'pruned_through_step') or '-1')
  if upto > done then
    local samples, tokens = 0, 0
    local old = redis.call('ZRANGEBYSCORE', P .. 'trained', '(' .. done, upto)
    for _, gid in ipairs(old) do
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
    redis.call('HSET', stats, 'pruned_through_step', upto)
    redis.call('HINCRBY', stats, 'pruned_groups', #old)
    redis.call('HINCRBY', stats, 'pruned_samples', samples)
    redis.call('HINCRBY', stats, 'pruned_tokens', tokens)
  end
end
return #gids
