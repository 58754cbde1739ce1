-- Count an event on a batch's meta hash, unless the batch is gone (expired or deleted): a
-- late stale task must not bring back a meta hash with no TTL that nothing would remove.
-- KEYS: meta   ARGV: field, n
local meta_key = KEYS[1]
local field, n = ARGV[1], ARGV[2]
if redis.call('EXISTS', meta_key) == 0 then return 0 end
return redis.call('HINCRBY', meta_key, field, n)
