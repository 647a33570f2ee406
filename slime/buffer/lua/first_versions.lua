-- ARGV: prefix, max_each. The first token's policy version of up to max_each running (leased) and
-- aborted (resume queue) samples that have tokens: the dashboard's staleness, one round trip.
local n = tonumber(ARGV[2])
local out = {}
local sids = redis.call('ZRANGE', P .. 'leases', 0, n - 1)
for _, sid in ipairs(redis.call('LRANGE', P .. 'queue:resume', 0, n - 1)) do sids[#sids + 1] = sid end
for _, sid in ipairs(sids) do
  local first = redis.call('GETRANGE', P .. 'sample:' .. sid .. ':ver', 0, 3)
  if #first == 4 then out[#out + 1] = struct.unpack('<i4', first) end
end
return out
