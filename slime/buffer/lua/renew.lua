-- ARGV: prefix, worker, lease_seconds, sample ids...
local worker = ARGV[2]
local expiry = fmt(now() + tonumber(ARGV[3]))
local lost = {}
for i = 4, #ARGV do
  local sid = ARGV[i]
  if lost_lease(sid, worker) then
    lost[#lost + 1] = sid
  else
    redis.call('ZADD', P .. 'leases', expiry, sid)
  end
end
return lost
