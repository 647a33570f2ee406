-- ARGV: prefix, after_step ('' = every uncommitted claim)
local low = '-inf'
if ARGV[2] ~= '' then low = '(' .. ARGV[2] end
local gids = redis.call('ZRANGEBYSCORE', P .. 'claimed', low, '+inf')
-- pushed to the front in reverse, so the earliest claimed group is first in line again
for i = #gids, 1, -1 do back_to_ready('claimed', gids[i]) end
-- They wait for training again: the in-order claim (claim_in_order.lua) looks from the start.
if #gids > 0 then redis.call('DEL', P .. 'claim_cursor') end
return #gids
