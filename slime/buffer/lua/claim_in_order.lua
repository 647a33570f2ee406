-- ARGV: prefix, max_groups, step, dry_run ('1': only count, claim nothing)
-- Async training in start order. The oldest groups still waiting for training (open or ready, by
-- start time) are the next batch, and only the ready ones at the head of that line are claimed: a
-- group finishing early does not overtake an older one. Group k is then trained at step k // B,
-- which is what the async admission counted on (april/scheduler.py), so no group is trained more
-- than max_staleness versions after the version it started under. Returns the claimed group ids;
-- with dry_run, how many groups at the head of the line are ready (at most max_groups).
local max_groups, step, dry = tonumber(ARGV[2]), ARGV[3], ARGV[4] == '1'
-- claim_cursor: how many of the oldest groups are done waiting (claimed, trained or dropped).
local cursor = tonumber(redis.call('GET', P .. 'claim_cursor') or '0')
local head, pos, blocked = {}, cursor, false
while not blocked and #head < max_groups do
  local window = redis.call('ZRANGE', P .. 'groups', pos, pos + 63)
  if #window == 0 then break end
  for _, gid in ipairs(window) do
    local status = redis.call('HGET', P .. 'group:' .. gid, 'status')
    if status == 'open' then
      blocked = true
    elseif status == 'ready' then
      head[#head + 1] = gid
    elseif #head == 0 then
      cursor = pos + 1
    end
    pos = pos + 1
    if blocked or #head >= max_groups then break end
  end
end
redis.call('SET', P .. 'claim_cursor', cursor)
if dry then return #head end
for _, gid in ipairs(head) do
  redis.call('LREM', P .. 'queue:ready', 1, gid)
  redis.call('HSET', P .. 'group:' .. gid, 'status', 'claimed', 'claimed_step', step, 'claim_seq', redis.call('INCR', P .. 'claim_seq'))
  redis.call('ZADD', P .. 'claimed', step, gid)
end
return head
