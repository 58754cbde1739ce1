-- Renew a semaphore slot only while its holder still has it (Redis TIME, like sem_acquire).
-- KEYS: sem zset   ARGV: holder, ttl_ms
-- Returns 1 when renewed, 0 when the holder is gone (expired, evicted or deleted): the holder
-- must learn that it runs uncounted, not silently take a slot back past the limit.
local sem_key = KEYS[1]
local holder, ttl_ms = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', sem_key, '-inf', now)
if not redis.call('ZSCORE', sem_key, holder) then return 0 end
redis.call('ZADD', sem_key, now + ttl_ms, holder)
return 1
