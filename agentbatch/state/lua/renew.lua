-- Extend a lease we still hold, and push the agent's progress deadline with it.
-- KEYS: lease, watch   ARGV: token, ttl_ms, now_ms, index
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
return 1
