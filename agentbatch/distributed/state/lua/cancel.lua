-- Cancel a batch, only where it still exists: a HSET on a meta hash that expired would make a
-- new one without a TTL, which `agentbatch ls` lists as "cancelling" for ever.
-- KEYS: meta
-- Returns 1 when the batch was marked cancelled (or already was), 2 when it had finished
-- (nothing to stop: left as it ended), 0 when its meta is gone (expired or deleted).
local meta_key = KEYS[1]
if redis.call('EXISTS', meta_key) == 0 then return 0 end
if redis.call('HGET', meta_key, 'finished') == '1' then return 2 end
redis.call('HSET', meta_key, 'cancelled', 1)
return 1
