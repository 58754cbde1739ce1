-- Extend a lock only while we still hold it.   KEYS: lock   ARGV: token, ttl_ms
local lock_key = KEYS[1]
local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('GET', lock_key) == token then return redis.call('PEXPIRE', lock_key, ttl_ms) end
return 0
