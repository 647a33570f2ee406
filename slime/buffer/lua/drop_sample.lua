-- ARGV: prefix, sid, reason. Dashboard control: an unfinished sample becomes FAILED with the reason
-- (its group can still complete). Stale queue entries are skipped by lease.lua, so no LREM is needed.
local sid, reason = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
local status = redis.call('HGET', skey, 'status')
if not status then return {-4, ''} end
if status ~= 'pending' and status ~= 'aborted' and status ~= 'running' then return {-5, status} end
redis.call('ZREM', P .. 'leases', sid)
redis.call('HDEL', skey, 'lease_owner')
redis.call('DEL', skey .. ':env')
redis.call('HSET', skey, 'status', 'failed', 'failure', reason, 'updated_at', fmt(now()))
move_count(status, 'failed')
redis.call('HINCRBYFLOAT', P .. 'stats', 'dropped_samples:dashboard', 1)
member_done(redis.call('HGET', skey, 'group_id'))
return {0, status}
