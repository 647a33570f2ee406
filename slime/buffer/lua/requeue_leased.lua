-- ARGV: prefix. Every leased sample back to the resume queue (a restarted job: the old workers are gone).
local sids = redis.call('ZRANGE', P .. 'leases', 0, -1)
local n = 0
for _, sid in ipairs(sids) do
  redis.call('ZREM', P .. 'leases', sid)
  if redis.call('HGET', P .. 'sample:' .. sid, 'status') == 'running' then
    requeue_running(sid)
    n = n + 1
  end
end
return n
