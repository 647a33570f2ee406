-- ARGV: prefix, gid, n, max_new_tokens, prompt bytes, metadata json, draw ('' for none: the
-- sampler's count of prompts drawn, this one included), streaming ('1': its samples are trained
-- segment by segment, in the same call so that no kill leaves a group streaming never trains),
-- sample ids (n of them)
local gid, n = ARGV[2], tonumber(ARGV[3])
local gkey = P .. 'group:' .. gid
if redis.call('EXISTS', gkey) == 1 then return 0 end
local t = fmt(now())
redis.call('HSET', gkey, 'n', n, 'done', 0, 'status', 'open', 'created_at', t, 'metadata', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', gkey, 'draw', ARGV[7]) end
redis.call('ZADD', P .. 'groups', t, gid)
for i = 1, n do
  local sid = ARGV[8 + i]
  redis.call('HSET', P .. 'sample:' .. sid, 'group_id', gid, 'index', i - 1, 'status', 'pending',
    'prompt_ids', ARGV[5], 'max_new_tokens', ARGV[4], 'metadata', ARGV[6], 'created_at', t, 'updated_at', t)
  redis.call('RPUSH', gkey .. ':samples', sid)
  redis.call('RPUSH', P .. 'queue:new', sid)
end
redis.call('HINCRBY', P .. 'status_counts', 'pending', n)
-- Wakes an idle worker waiting on it (TrajectoryStore.wait_for_work_signal); at most one element.
redis.call('RPUSH', P .. 'signal:work', '1')
redis.call('LTRIM', P .. 'signal:work', -1, -1)
if ARGV[8] == '1' then redis.call('SADD', P .. 'stream:untrained', unpack(ARGV, 9, 8 + n)) end
return 1
