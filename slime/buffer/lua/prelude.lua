-- Loaded in front of every script (slime/buffer/connection.py). ARGV[1] is always the job prefix:
-- key names are built from it, so the scripts need a standalone (or Sentinel) Redis, not Cluster.
local P = ARGV[1]
-- The Redis server's clock (seconds), which every worker agrees on whatever its own clock says.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
