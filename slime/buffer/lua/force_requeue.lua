-- ARGV: prefix, sid. Dashboard control: a RUNNING sample back to the front of the resume queue,
-- tokens kept, as if its lease had expired (the worker's next write finds the lease lost).
local sid = ARGV[2]
local status = redis.call('HGET', P .. 'sample:' .. sid, 'status')
if not status then return {-4, ''} end
if status ~= 'running' then return {-5, status} end
requeue_running(sid)
return {0, status}
