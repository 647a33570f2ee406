-- ARGV: prefix, max_groups, step
local max_groups, step = tonumber(ARGV[2]), ARGV[3]
local claimed = {}
while #claimed < max_groups do
  local gid = redis.call('LPOP', P .. 'queue:ready')
  if not gid then break end
  local gkey = P .. 'group:' .. gid
  if redis.call('HGET', gkey, 'status') == 'ready' then
    -- claim_seq: the order the learner took them in (slime replay feeds them in the same order)
    redis.call('HSET', gkey, 'status', 'claimed', 'claimed_step', step, 'claim_seq', redis.call('INCR', P .. 'claim_seq'))
    redis.call('ZADD', P .. 'claimed', step, gid)
    claimed[#claimed + 1] = gid
  end
end
return claimed
