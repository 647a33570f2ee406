-- ARGV: prefix
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
