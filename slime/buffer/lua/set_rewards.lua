-- ARGV: prefix, then four per sample: sid, reward ('' = none), failure ('' = none), metadata json
-- ('' = unchanged). reward.scope=group: the learner's scores of a claimed group's samples. A failure
-- makes the sample FAILED (counted once however often the group is scored). Returns how many exist.
local n = 0
for i = 2, #ARGV, 4 do
  local skey = P .. 'sample:' .. ARGV[i]
  local status = redis.call('HGET', skey, 'status')
  if status then
    if ARGV[i + 1] ~= '' then redis.call('HSET', skey, 'reward', ARGV[i + 1]) end
    if ARGV[i + 2] ~= '' then
      redis.call('HSET', skey, 'failure', ARGV[i + 2])
      if status ~= 'failed' then
        redis.call('HSET', skey, 'status', 'failed')
        move_count(status, 'failed')
      end
    end
    if ARGV[i + 3] ~= '' then redis.call('HSET', skey, 'metadata', ARGV[i + 3]) end
    redis.call('HSET', skey, 'updated_at', fmt(now()))
    n = n + 1
  end
end
return n
