-- ARGV: prefix, gid, reason. A group claimed for a step but not trained (e.g. beyond the learner's
-- staleness bound) leaves the claimed set for good, so the step's commit does not count it trained.
local gid, reason = ARGV[2], ARGV[3]
if redis.call('ZREM', P .. 'claimed', gid) == 0 then return 0 end
drop_group(gid, reason)
return 1
