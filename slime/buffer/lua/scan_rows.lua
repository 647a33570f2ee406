-- ARGV: prefix, rank, pos, limit, max_scan, statuses (',a,b,' or '' for any), then min/max of
-- length, reward, version span, age in seconds ('' = unbounded). Read-only listing for the dashboard:
-- walks groups from creation rank `rank` down (newest first), samples from position `pos`, and
-- returns {next rank, next pos, scanned, rows, server time}; a row is sid, the 8 ROW_FIELDS (queries.py)
-- ('' = absent), response length, first and last token version ('' when no tokens). Ranks count the
-- groups whose records were deleted (stats forgotten_*, the oldest as a rule), so a page cursor
-- stays on its group when a checkpoint forgets old ones.
local rank, pos = tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, max_scan, statuses = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local function bound(i) if ARGV[i] == '' then return nil end return tonumber(ARGV[i]) end
local min_len, max_len, min_rw, max_rw = bound(7), bound(8), bound(9), bound(10)
local min_span, max_span, min_age, max_age = bound(11), bound(12), bound(13), bound(14)
local t = now()
local function outside(x, lo, hi)
  if lo == nil and hi == nil then return false end
  if x == nil then return true end
  return (lo ~= nil and x < lo) or (hi ~= nil and x > hi)
end
local forgotten = 0
for _, v in ipairs(redis.call('HMGET', P .. 'stats', 'forgotten_groups_trained', 'forgotten_groups_dropped')) do
  forgotten = forgotten + (tonumber(v or '0') or 0)
end
rank = rank - forgotten
local total = redis.call('ZCARD', P .. 'groups')
if rank >= total then rank, pos = total - 1, 0 end
local rows, found, scanned = {}, 0, 0
while rank >= 0 and found < limit and scanned < max_scan do
  local gid = redis.call('ZRANGE', P .. 'groups', rank, rank)[1]
  local sids = redis.call('LRANGE', P .. 'group:' .. gid .. ':samples', pos, -1)
  if #sids == 0 then scanned = scanned + 1 end  -- a pruned group: the walk past many stays bounded
  local i = 0
  while i < #sids and found < limit and scanned < max_scan do
    i = i + 1
    scanned = scanned + 1
    local sid = sids[i]
    local skey = P .. 'sample:' .. sid
    local f = redis.call('HMGET', skey, 'group_id', 'index', 'status', 'reward', 'failure', 'created_at',
      'updated_at', 'max_new_tokens')
    if f[3] and (statuses == '' or string.find(statuses, ',' .. f[3] .. ',', 1, true)) then
      local n = redis.call('STRLEN', skey .. ':mask')
      local first, last, span = '', '', nil
      if n > 0 then
        first = struct.unpack('<i4', redis.call('GETRANGE', skey .. ':ver', 0, 3))
        last = struct.unpack('<i4', redis.call('GETRANGE', skey .. ':ver', -4, -1))
        span = last - first
      end
      if not (outside(n, min_len, max_len) or outside(tonumber(f[4] or ''), min_rw, max_rw)
              or outside(span, min_span, max_span) or outside(t - tonumber(f[6]), min_age, max_age)) then
        found = found + 1
        rows[#rows + 1] = sid
        for k = 1, 8 do rows[#rows + 1] = f[k] or '' end
        rows[#rows + 1] = tostring(n)
        rows[#rows + 1] = tostring(first)
        rows[#rows + 1] = tostring(last)
      end
    end
  end
  if i >= #sids then rank, pos = rank - 1, 0 else pos = pos + i end
end
if rank >= 0 then rank = rank + forgotten else rank = -1 end
return {rank, pos, scanned, rows, fmt(t)}
