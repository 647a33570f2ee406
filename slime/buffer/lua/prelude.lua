-- Loaded in front of every script (slime/buffer/connection.py). ARGV[1] is always the job prefix:
-- key names are built from it. On a Redis Cluster the prefix carries the job's hash tag, so every
-- key a script touches lies in the slot of the one key the call names (KEYS[1]).
local P = ARGV[1]
-- The Redis server's clock (seconds), which every worker agrees on whatever its own clock says.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
