-- ARGV: prefix, action ('claim' | 'renew' | 'release'), me (the owner's json), ttl_ms, same (a
-- prefix of `me` that marks the same run: its output_dir).
-- claim: take the job's owner key if it is free, expired or held by the same run; else return the
-- holder and its remaining ttl. renew: keep it, or take it back when it is free (a Redis that lost
-- it); release: only while `me` holds it. One live run per job name: a fresh run deletes the job's
-- keys, which would wipe another live run's buffer.
local key, action, me, ttl, same = P .. 'owner', ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local holder = redis.call('GET', key)
local ours = (not holder) or holder == me or string.sub(holder, 1, #same) == same
if action == 'release' then
  if holder == me then redis.call('DEL', key) end
  return {1, '', 0}
end
if not ours or (action == 'renew' and holder and holder ~= me) then
  return {0, holder, redis.call('PTTL', key)}
end
redis.call('SET', key, me, 'PX', ttl)
return {1, '', ttl}
