-- Extend a lease we still hold, and push the agent's progress deadline (still started) with it.
-- KEYS: lease, watch   ARGV: token, ttl_ms, now_ms, watch member
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
-- XX: an agent of a batch deleted or expired meanwhile must not bring back its watch set
redis.call('ZADD', KEYS[2], 'XX', started_at(tonumber(ARGV[3]) + tonumber(ARGV[2])), ARGV[4])
return 1
