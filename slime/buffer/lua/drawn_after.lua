-- ARGV: prefix, draws. Reads only. The groups the sampler drew after its first `draws` prompts, for
-- a resume's sampler to walk over: {draw, status, record_index ('' where unknown), ...}, newest
-- first. Left out: groups an earlier resume dropped as drawn after its checkpoint (their draw
-- numbers were drawn again). A group with a streamed segment reads 'trained': that segment's update
-- is not in the checkpoint.
local out = {}
for _, gid in ipairs(groups_drawn_after(tonumber(ARGV[2]))) do
  local gkey = P .. 'group:' .. gid
  local f = redis.call('HMGET', gkey, 'draw', 'status', 'metadata', 'drop_reason')
  if f[4] ~= 'drawn_after_checkpoint' then
    local status = f[2] or ''
    for _, sid in ipairs(redis.call('LRANGE', gkey .. ':samples', 0, -1)) do
      if tonumber(redis.call('HGET', P .. 'sample:' .. sid, 'trained_upto') or '0') > 0 then status = 'trained' end
    end
    local index = ''
    local ok, meta = pcall(cjson.decode, f[3] or '')
    if ok and type(meta) == 'table' and type(meta['record_index']) == 'number' then
      index = string.format('%.17g', meta['record_index'])  -- tostring keeps 14 digits
    end
    out[#out + 1] = f[1]
    out[#out + 1] = status
    out[#out + 1] = index
  end
end
return out
