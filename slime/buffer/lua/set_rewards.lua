-- ARGV: prefix, then five per sample: sid, reward ('' = none), failure ('' = none), metadata json
-- ('' = unchanged), status ('' = unchanged). reward.scope=group: the learner's scores of a claimed
-- group's samples, written again when a requeued claim is scored again. A reward clears an earlier
-- failure and a failure an earlier reward; a status change moves the counts. Returns how many exist.
local n = 0
for i = 2, #ARGV, 5 do
  local skey = P .. 'sample:' .. ARGV[i]
  local status = redis.call('HGET', skey, 'status')
  if status then
    if ARGV[i + 1] ~= '' then
      redis.call('HSET', skey, 'reward', ARGV[i + 1])
      redis.call('HDEL', skey, 'failure')
    end
    if ARGV[i + 2] ~= '' then
      redis.call('HSET', skey, 'failure', ARGV[i + 2])
      redis.call('HDEL', skey, 'reward')
    end
    if ARGV[i + 3] ~= '' then redis.call('HSET', skey, 'metadata', ARGV[i + 3]) end
    local to = ARGV[i + 4]
    if to ~= '' and to ~= status then
      redis.call('HSET', skey, 'status', to)
      move_count(status, to)
    end
    redis.call('HSET', skey, 'updated_at', fmt(now()))
    n = n + 1
  end
end
return n
