-- ARGV: prefix, sid, worker, status, reward ('' = none), failure ('' = none),
--       has_token_rewards ('0'|'1'), token_rewards bytes, metadata json ('' = unchanged),
--       stored_length ('' = unchecked)
local sid, worker, status = ARGV[2], ARGV[3], ARGV[4]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
-- A response shorter than the writer knows it to be lost its tail with Redis's unsynced writes:
-- it is not final; the writer releases it and it resumes from what is stored.
local expected = tonumber(ARGV[10])
local stored = redis.call('STRLEN', skey .. ':mask')
if expected and expected ~= stored then
  if stored < expected then redis.call('HINCRBYFLOAT', P .. 'stats', 'lost_chunk_tokens', expected - stored) end
  return {-6, stored .. ':' .. expected}
end
if ARGV[7] == '1' and #ARGV[8] ~= 4 * stored then
  return {-2, string.format('token_rewards has %d values, the response %d tokens', #ARGV[8] / 4, stored)}
end
local t = fmt(now())
redis.call('HSET', skey, 'status', status, 'updated_at', t)
if ARGV[5] ~= '' then redis.call('HSET', skey, 'reward', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', skey, 'failure', ARGV[6]) end
if ARGV[7] == '1' then redis.call('HSET', skey, 'token_rewards', ARGV[8]) end
if ARGV[9] ~= '' then redis.call('HSET', skey, 'metadata', ARGV[9]) end
redis.call('HDEL', skey, 'lease_owner')
redis.call('ZREM', P .. 'leases', sid)
redis.call('DEL', skey .. ':env')  -- an env snapshot only serves resuming an unfinished episode
move_count('running', status)
if member_done(redis.call('HGET', skey, 'group_id')) then return {0, 1} end
return {0, 0}
