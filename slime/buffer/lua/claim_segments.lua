-- ARGV: prefix, chunk_tokens, max_segments, dry ('1': only count). Streaming (GLM-5 variant):
-- a segment is every untrained token of a sample once there are >= chunk of them, or once the
-- sample is final. A final sample whose tokens were all trained already yields its last token
-- again (start = end - 1), so its reward still reaches the learner.
-- ARGV[5]: the learner's step, the trained group's score (commit_through prunes by it).
local chunk, max_segments, dry, step = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1', ARGV[5]
local set = P .. 'stream:untrained'
local out, count = {}, 0
-- A final member leaves the set; the group is trained once all n have (tokenless ones included:
-- a member failed before its first token still counts, or the group would stay ready for good).
local function member_done(sid, gid)
  redis.call('SREM', set, sid)
  local gkey = P .. 'group:' .. gid
  if redis.call('HINCRBY', gkey, 'trained_members', 1) >= tonumber(redis.call('HGET', gkey, 'n')) then
    redis.call('LREM', P .. 'queue:ready', 0, gid)
    redis.call('HSET', gkey, 'status', 'trained')
    redis.call('ZADD', P .. 'trained', step, gid)
  end
end
for _, sid in ipairs(redis.call('SMEMBERS', set)) do
  if count >= max_segments then break end
  local skey = P .. 'sample:' .. sid
  local status = redis.call('HGET', skey, 'status')
  local gid = status and redis.call('HGET', skey, 'group_id')
  if not status or redis.call('HGET', P .. 'group:' .. gid, 'status') == 'dropped' then
    redis.call('SREM', set, sid)  -- gone, or its group dropped (a resume drew its prompt again)
  else
    local len = redis.call('STRLEN', skey .. ':mask')
    local upto = tonumber(redis.call('HGET', skey, 'trained_upto') or '0')
    local final = status == 'completed' or status == 'truncated' or status == 'failed'
    if len - upto >= chunk or (final and len > 0) then
      count = count + 1
      if not dry then
        local start = upto
        if final and start >= len then start = len - 1 end
        redis.call('HSET', skey, 'trained_upto', len)
        if final then member_done(sid, gid) end
        out[#out + 1] = sid
        out[#out + 1] = tostring(start)
        out[#out + 1] = tostring(len)
        out[#out + 1] = final and '1' or '0'
        out[#out + 1] = redis.call('HGET', skey, 'restarts') or '0'
      end
    elseif final then
      -- Final with no tokens at all: nothing to train. Done in a count too: when every group in
      -- flight ends so, no segment ever comes and only a count runs (fleet.wait_for_segments).
      member_done(sid, gid)
    end
  end
end
if dry then return count end
return out
