-- Count an event on a batch's meta hash, unless the batch is gone (expired or deleted): a
-- late stale task must not bring back a meta hash with no TTL that nothing would remove.
-- KEYS: meta   ARGV: field, n
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
