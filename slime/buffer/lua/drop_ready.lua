-- ARGV: prefix, gid, reason. Only a group waiting in the ready queue can be dropped.
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
