-- ARGV: prefix, gid, reason. Only a group waiting in the ready queue can be dropped.
local gid, reason = ARGV[2], ARGV[3]
if redis.call('LREM', P .. 'queue:ready', 0, gid) == 0 then return 0 end
drop_group(gid, reason)
return 1
