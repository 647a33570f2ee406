-- Loaded in front of drawn_after.lua and drop_drawn_after.lua (after prelude.lua).
-- The ids of the groups the sampler drew after its first `limit` prompts (their 'draw' is higher),
-- newest first. Groups are drawn in creation order: the scan goes from the newest back and stops
-- at a window of 64 with none of them (so groups created in one millisecond are all seen).
local function groups_drawn_after(limit)
  local found, stop, pos = {}, false, 0
  while not stop do
    local window = redis.call('ZREVRANGE', P .. 'groups', pos, pos + 63)
    if #window == 0 then break end
    stop = true
    for _, gid in ipairs(window) do
      local draw = tonumber(redis.call('HGET', P .. 'group:' .. gid, 'draw') or '')
      if draw and draw > limit then
        stop = false
        found[#found + 1] = gid
      end
    end
    pos = pos + 64
  end
  return found
end
