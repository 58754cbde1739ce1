-- A counting semaphore whose holders expire, so a killed worker never leaks a slot.
-- KEYS: sem zset, aimd hash, waiters zset (by rank), waiters' expiry zset
-- ARGV: holder, limit, ttl_ms, priority ('' = do not queue), wait_ttl_ms
-- Expiry scores are Redis's own clock (TIME), never a worker's: one worker's clock running
-- ahead would otherwise see every live holder as expired and evict it.
-- The effective limit is min(limit, aimd.limit) when the fleet-wide AIMD hash has one.
-- A current holder is always re-scored (renewal): a shrinking limit evicts no one.
-- Waiters (priority given) queue: rank = priority * 1e13 + the Redis ms of their first try
-- (lower first: fewer turns left, then arrival), kept while they keep asking; a free slot
-- goes to the first waiters only, so a request that asks at the right moment cannot
-- overtake one that has waited longer or is nearer done. A waiter that stops asking (its
-- worker died) is dropped wait_ttl_ms later; the keys expire when nobody waits.
-- Without a priority, a caller takes a free slot only when nobody waits.
-- Returns {acquired 0/1, the aimd limit or -1 when there is none, waiters ahead of it}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local dynamic = -1
local limit = tonumber(ARGV[2])
local stored = tonumber(redis.call('HGET', KEYS[2], 'limit'))
if stored then
  dynamic = stored
  if stored < limit then limit = stored end
end
local expires = now + tonumber(ARGV[3])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], expires, ARGV[1])
  return {1, dynamic, 0}
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #gone > 0 then
  redis.call('ZREM', KEYS[3], unpack(gone))
  redis.call('ZREM', KEYS[4], unpack(gone))
end
local free = limit - redis.call('ZCARD', KEYS[1])
local ahead = 0
if ARGV[4] == '' then
  ahead = redis.call('ZCARD', KEYS[3])
else
  if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
    redis.call('ZADD', KEYS[3], tonumber(ARGV[4]) * 1e13 + now, ARGV[1])
  end
  ahead = redis.call('ZRANK', KEYS[3], ARGV[1])
end
if ahead < free then
  redis.call('ZADD', KEYS[1], expires, ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  return {1, dynamic, 0}
end
if ARGV[4] ~= '' then
  local wait_ttl = tonumber(ARGV[5])
  redis.call('ZADD', KEYS[4], now + wait_ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[3], wait_ttl)
  redis.call('PEXPIRE', KEYS[4], wait_ttl)
end
return {0, dynamic, ahead}
