-- ARGV: prefix, draws, reason. A resume from a checkpoint whose sampler had drawn `draws` prompts
-- (or as far as its walk went, sampling.fast_forward): every group drawn after that is dropped,
-- whatever its state, since the sampler draws those prompts again. Trained ones too: streaming marks
-- a group trained as its last segment trains, and a resume from an older checkpoint finds groups
-- later checkpoints committed; either way the weights that learned from them are gone. Unfinished
-- samples become FAILED with the reason (queue entries left behind are skipped by lease.lua); the
-- group leaves the ready queue, the claimed or the trained set.
-- Returns {groups dropped, their tokens}; stats count them as dropped_groups/tokens:<reason>.
local reason = ARGV[3]
local groups, tokens = 0, 0
for _, gid in ipairs(groups_drawn_after(tonumber(ARGV[2]))) do
  local gkey = P .. 'group:' .. gid
  if redis.call('HGET', gkey, 'status') ~= 'dropped' then
    redis.call('LREM', P .. 'queue:ready', 0, gid)
    redis.call('ZREM', P .. 'claimed', gid)
    redis.call('ZREM', P .. 'trained', gid)
    for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
      local skey = P .. 'sample:' .. sid
      local s = redis.call('HGET', skey, 'status')
      if s == 'pending' or s == 'aborted' or s == 'running' then
        redis.call('ZREM', P .. 'leases', sid)
        redis.call('HDEL', skey, 'lease_owner')
        redis.call('DEL', skey .. ':env')
        redis.call('HSET', skey, 'status', 'failed', 'failure', reason, 'updated_at', fmt(now()))
        move_count(s, 'failed')
      end
      redis.call('SREM', P .. 'stream:untrained', sid)  -- streaming: none of it trains now
    end
    tokens = tokens + drop_group(gid, reason)
    groups = groups + 1
  end
end
if groups > 0 then redis.call('DEL', P .. 'claim_cursor') end  -- the in-order claim looks from the start again
return {groups, tokens}
