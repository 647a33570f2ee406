-- ARGV: prefix, then (group id, step) pairs. A claim Redis lost (the AOF's unsynced second at a
-- crash) that the same learner claimed again at a later step: the group keeps its first claim's
-- step, so the checkpoint that covers that step commits it, and it is not trained a second time.
local n = 0
for i = 2, #ARGV, 2 do
  local gid, step = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', P .. 'group:' .. gid, 'status') == 'claimed' then
    redis.call('HSET', P .. 'group:' .. gid, 'claimed_step', step)
    redis.call('ZADD', P .. 'claimed', step, gid)
    n = n + 1
  end
end
redis.call('HINCRBY', P .. 'stats', 'reclaimed_groups', n)  -- claims found lost, kept from training twice
return n
