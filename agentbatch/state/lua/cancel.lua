-- Cancel a batch, only where it still exists: a HSET on a meta hash that expired would make a
-- new one without a TTL, which `agentbatch ls` lists as "cancelling" for ever.
-- KEYS: meta
-- Returns 1 when the batch was marked cancelled (or already was), 2 when it had finished
-- (nothing to stop: left as it ended), 0 when its meta is gone (expired or deleted).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'finished') == '1' then return 2 end
redis.call('HSET', KEYS[1], 'cancelled', 1)
return 1
