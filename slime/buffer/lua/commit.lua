-- ARGV: prefix, step
local step = ARGV[2]
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', step, step)
for _, gid in ipairs(gids) do
  redis.call('ZREM', P .. 'claimed', gid)
  redis.call('ZADD', P .. 'trained', step, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'trained')
end
return #gids
