-- ARGV: prefix, worker, max_items, lease_seconds. Returns, per leased sample, {sid, its hash as a
-- flat list, tok, lp, ver, mask}: leased and read in one round trip, a consistent snapshot.
local worker, max_items, lease_s = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = now()
local leased = {}
for _, queue in ipairs({'queue:resume', 'queue:new'}) do
  while #leased < max_items do
    local sid = redis.call('LPOP', P .. queue)
    if not sid then break end
    local skey = P .. 'sample:' .. sid
    local status = redis.call('HGET', skey, 'status')
    -- anything else is a stale entry (sample deleted or already leased): drop it
    if status == 'pending' or status == 'aborted' then
      redis.call('HSET', skey, 'status', 'running', 'lease_owner', worker, 'updated_at', fmt(t))
      redis.call('ZADD', P .. 'leases', fmt(t + lease_s), sid)
      move_count(status, 'running')
      leased[#leased + 1] = {sid, redis.call('HGETALL', skey), redis.call('GET', skey .. ':tok') or false,
        redis.call('GET', skey .. ':lp') or false, redis.call('GET', skey .. ':ver') or false,
        redis.call('GET', skey .. ':mask') or false}
    end
  end
end
return leased
