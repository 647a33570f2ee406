-- ARGV: prefix, sid, worker
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
requeue_running(sid)
return {0, 0}
