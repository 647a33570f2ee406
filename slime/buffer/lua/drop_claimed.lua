-- ARGV: prefix, gid, reason. A group claimed for a step but not trained (e.g. beyond the learner's
-- staleness bound) leaves the claimed set for good, so the step's commit does not count it trained.
local gid, reason = ARGV[2], ARGV[3]
if redis.call('ZREM', P .. 'claimed', gid) == 0 then return 0 end
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
return 1
