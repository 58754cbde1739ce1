-- Extend a lease we still hold, and push the agent's progress deadline with it.
-- KEYS: lease, watch   ARGV: token, ttl_ms, now_ms, watch member
local lease_key, watch_key = KEYS[1], KEYS[2]
local token, ttl_ms, now, member = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if redis.call('GET', lease_key) ~= token then return 0 end
redis.call('PEXPIRE', lease_key, ttl_ms)
-- XX: an agent of a batch deleted or expired meanwhile must not bring back its watch set
redis.call('ZADD', watch_key, 'XX', now + ttl_ms, member)
return 1
