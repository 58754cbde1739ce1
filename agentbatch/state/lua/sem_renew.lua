-- Renew a semaphore slot only while its holder still has it (Redis TIME, like sem_acquire).
-- KEYS: sem zset   ARGV: holder, ttl_ms
-- Returns 1 when renewed, 0 when the holder is gone (expired, evicted or deleted): the holder
-- must learn that it runs uncounted, not silently take a slot back past the limit.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
