-- ARGV: prefix, draws. Reads only. The groups the sampler drew after its first `draws` prompts:
-- {draw, status, metadata json, ...} (metadata '' where pruned). Groups are drawn in creation order:
-- the scan goes from the newest back and stops at a window of 64 with none of them.
local limit = tonumber(ARGV[2])
local out, stop, pos = {}, false, 0
while not stop do
  local window = redis.call('ZREVRANGE', P .. 'groups', pos, pos + 63)
  if #window == 0 then break end
  stop = true
  for _, gid in ipairs(window) do
    local gkey = P .. 'group:' .. gid
    local fields = redis.call('HMGET', gkey, 'draw', 'status', 'metadata')
    local draw = tonumber(fields[1] or '')
    if draw and draw > limit then
      stop = false
      out[#out + 1] = fields[1]
      out[#out + 1] = fields[2] or ''
      out[#out + 1] = fields[3] or ''
    end
  end
  pos = pos + 64
end
return out
