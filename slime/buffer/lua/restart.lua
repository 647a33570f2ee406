-- ARGV: prefix, sid, worker. Discard a leased sample's tokens so it starts over (staleness budget).
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
local n = redis.call('STRLEN', skey .. ':mask')
redis.call('DEL', skey .. ':tok', skey .. ':lp', skey .. ':ver', skey .. ':mask', skey .. ':route', skey .. ':env')
redis.call('HINCRBYFLOAT', P .. 'stats', 'restarted_tokens', n)
redis.call('HINCRBYFLOAT', P .. 'stats', 'restarted_samples', 1)
redis.call('HSET', skey, 'updated_at', fmt(now()))
-- Streaming: the new trajectory's tokens are all untrained (the discarded ones' update stays made).
redis.call('HDEL', skey, 'trained_upto')
redis.call('HINCRBY', skey, 'restarts', 1)
return {0, n}
