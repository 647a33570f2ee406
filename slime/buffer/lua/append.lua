-- ARGV: prefix, sid, worker, lease_seconds, tok, lp, ver, mask, stored_length ('' = unchecked),
-- route (routing replay: the same number of bytes per token; '' = none recorded),
-- env_state (a multi-turn env's snapshot after this observation; '' = unchanged): stored with the
-- tokens it belongs to in one step, so a snapshot never runs ahead of or behind the transcript
local sid, worker = ARGV[2], ARGV[3]
local skey = P .. 'sample:' .. sid
if redis.call('EXISTS', skey) == 0 then return {-4, ''} end
local lost = lost_lease(sid, worker)
if lost then return {-1, lost} end
local tok, lp, ver, mask = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local n = #mask
if #tok ~= 4 * n or #lp ~= 4 * n or #ver ~= 4 * n then
  return {-2, string.format('chunk bytes tok=%d lp=%d ver=%d mask=%d', #tok, #lp, #ver, #mask)}
end
local len_tok = redis.call('STRLEN', skey .. ':tok')
local len_lp = redis.call('STRLEN', skey .. ':lp')
local len_ver = redis.call('STRLEN', skey .. ':ver')
local len_mask = redis.call('STRLEN', skey .. ':mask')
if len_tok ~= 4 * len_mask or len_lp ~= 4 * len_mask or len_ver ~= 4 * len_mask then
  return {-3, string.format('stored bytes tok=%d lp=%d ver=%d mask=%d', len_tok, len_lp, len_ver, len_mask)}
end
-- The writer's count of what is stored must match. Exactly one chunk more, ending in this chunk's
-- tokens: this call was applied already and is sent again (its reply was lost); fewer: writes
-- Redis lost (the AOF's unsynced second before a crash of the machine); never append after a gap.
local expected = tonumber(ARGV[9])
if expected and expected ~= len_mask then
  if n > 0 and len_mask == expected + n and redis.call('GETRANGE', skey .. ':tok', 4 * expected, -1) == tok then
    -- A write that replicates: a WAIT after this resend then also covers the first run's append.
    redis.call('HSET', skey, 'updated_at', fmt(now()))
    return {0, len_mask}
  end
  if len_mask < expected then redis.call('HINCRBYFLOAT', P .. 'stats', 'lost_chunk_tokens', expected - len_mask) end
  return {-6, len_mask .. ':' .. expected}
end
-- Routing replay: ':route' keeps `width` bytes per stored token once any chunk brought some; tokens
-- without a record (an environment's, or stored before the first record) read 255 (none).
local route = ARGV[10] or ''
local have = redis.call('STRLEN', skey .. ':route')
local width = 0
if #route > 0 then width = #route / n elseif have > 0 then width = have / len_mask end
if width ~= math.floor(width) or (have > 0 and have ~= width * len_mask) then
  return {-2, string.format('routing bytes route=%d stored=%d for %d+%d tokens', #route, have, len_mask, n)}
end
if n > 0 then
  if width > 0 then
    if have == 0 and len_mask > 0 then redis.call('APPEND', skey .. ':route', string.rep('\255', width * len_mask)) end
    redis.call('APPEND', skey .. ':route', #route > 0 and route or string.rep('\255', width * n))
  end
  redis.call('APPEND', skey .. ':tok', tok)
  redis.call('APPEND', skey .. ':lp', lp)
  redis.call('APPEND', skey .. ':ver', ver)
  redis.call('APPEND', skey .. ':mask', mask)
  redis.call('HINCRBYFLOAT', P .. 'stats', 'generated_tokens', n)
end
if ARGV[11] and ARGV[11] ~= '' then redis.call('SET', skey .. ':env', ARGV[11]) end
local t = now()
redis.call('HSET', skey, 'updated_at', fmt(t))
redis.call('ZADD', P .. 'leases', fmt(t + tonumber(ARGV[4])), sid)
return {0, len_mask + n}
