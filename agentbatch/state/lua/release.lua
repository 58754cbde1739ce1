-- Drop a lease only if it is still ours, and the inference slot it may hold.
-- KEYS: lease, [sem zset]   ARGV: token
if KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[1]) end
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
