-- A counting semaphore whose holders expire, so a killed worker never leaks a slot.
-- KEYS: sem zset, [aimd hash]   ARGV: holder, limit, ttl_ms
-- Expiry scores are Redis's own clock (TIME), never a worker's: one worker's clock running
-- ahead would otherwise see every live holder as expired and evict it.
-- The effective limit is min(limit, aimd.limit) when the fleet-wide AIMD hash has one.
-- A current holder is always re-scored (renewal): a shrinking limit evicts no one.
-- Returns {acquired 0/1, the aimd limit or -1 when there is none}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local dynamic = -1
local limit = tonumber(ARGV[2])
if KEYS[2] then
  local stored = tonumber(redis.call('HGET', KEYS[2], 'limit'))
  if stored then
    dynamic = stored
    if stored < limit then limit = stored end
  end
end
local expires = now + tonumber(ARGV[3])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], expires, ARGV[1])
  return {1, dynamic}
end
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], expires, ARGV[1])
  return {1, dynamic}
end
return {0, dynamic}
