-- Extend a lock only while we still hold it.   KEYS: lock   ARGV: token, ttl_ms
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
