-- ARGV: prefix, from_step. A resume from a checkpoint older than the latest (resume=PATH): groups
-- trained at a step >= from_step taught weights the resumed run does not have, so they go back to
-- the ready queue (earliest first), to train again. Lost instead, and left trained: groups whose
-- trajectories were pruned (buffer.keep_trained_steps), and streamed ones (their segments trained
-- one by one; no step record says which came after the checkpoint). Returns {ready again, lost}.
local from = tonumber(ARGV[2])
local gids = redis.call('ZRANGEBYSCORE', P .. 'trained', from, '+inf')
local again, lost = {}, 0
for _, gid in ipairs(gids) do
  local f = redis.call('HMGET', P .. 'group:' .. gid, 'pruned', 'trained_members')
  if f[1] or f[2] then lost = lost + 1 else again[#again + 1] = gid end
end
for i = #again, 1, -1 do back_to_ready('trained', again[i]) end
if #again > 0 then redis.call('DEL', P .. 'claim_cursor') end
-- commit_through prunes trained groups by step from here: the resumed run trains at steps >= from,
-- maybe lower than the horizon already pruned, whether or not any group is ready again (keep 0 and
-- streaming leave none).
local done = tonumber(redis.call('HGET', P .. 'stats', 'pruned_through_step') or '-1')
if done >= from then redis.call('HSET', P .. 'stats', 'pruned_through_step', from - 1) end
return {#again, lost}
