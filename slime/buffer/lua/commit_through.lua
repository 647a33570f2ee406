-- ARGV: prefix, step. Every claim of a step <= step becomes trained (their update is in a checkpoint).
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', ARGV[2])
for _, gid in ipairs(gids) do
  local step = redis.call('ZSCORE', P .. 'claimed', gid)
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
return #gids
