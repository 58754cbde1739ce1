-- Extend a lease we still hold, and push the agent's progress deadline with it.
-- KEYS: lease, watch   ARGV: token, ttl_ms, now_ms, watch member
-- One command checks and extends (SET XX GET: a turn waiting for an inference slot renews
-- every ttl/3, so this runs about once per turn): a lease that lapsed is not recreated (XX),
-- and one another claimer took after ours lapsed is put back as it was, with a full ttl_ms
-- (its holder is delayed at most ttl_ms should it die; its token, the fence, is unchanged).
local lease_key, watch_key = KEYS[1], KEYS[2]
local token, ttl_ms, now, member = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local held = redis.call('SET', lease_key, token, 'XX', 'PX', ttl_ms, 'GET')
if held ~= token then
  if held then redis.call('SET', lease_key, held, 'PX', ttl_ms) end
  return 0
end
-- XX: an agent of a batch deleted or expired meanwhile must not bring back its watch set
redis.call('ZADD', watch_key, 'XX', now + ttl_ms, member)
return 1
